"""One client's round, independent of Flower's API flavour.

Both the Message-API ClientApp and the legacy NumPyClient call
:func:`train_round` / :func:`evaluate_round`; only the packing differs.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict

from fedadapt.client.local_update import (
    LocalStart,
    client_update,
    load_client_state,
    save_client_state,
)
from fedadapt.client.process_info import process_age_s
from fedadapt.client.training import train_local
from fedadapt.optimizers import OPTIMIZERS
from fedadapt.strategies import wire
from fedadapt.tasks import TASKS, ClientData, evaluate_model, pick_device
from fedadapt.tasks.node_data import NodeDataError, load_node_data
from fedadapt.tasks.ready_data import ready_client_data, tree_signature

#: Clients whose data a process keeps (index lists into the task's cached
#: split, not copies): a simulation actor serves many nodes in turn.
CLIENT_DATA_CACHE = 1024


@dataclass(frozen=True)
class RoundResult:
    """What a client sends back after training."""

    state: dict[str, torch.Tensor]  # CPU state_dict of the trained model
    metrics: dict[str, float | int]
    local_arrays: dict[str, np.ndarray] | None = None  # the local update's, sent back


def client_seed(cfg: Mapping[str, Any], server_round: int, partition_id: int) -> int:
    """Seed of a client's shuffling in a round (same across restarts)."""
    return cfg["seed"] * 1_000_003 + server_round * 10_007 + partition_id


@contextmanager
def client_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Seed torch's global RNG for one client round, then restore it.

    Local training draws from the global RNG wherever a model does (dropout
    masks; a model built per message draws its throw-away initial weights).
    In simulation one Ray actor serves many clients in turn, so without
    this a client's masks depended on which clients the actor had served
    before: a CNN cell gave other numbers on every run. Seeded from the
    client's round seed (:func:`client_seed`, through a SeedSequence so the
    stream differs from the shuffling generator's) the round is the same
    in every process, and the caller's RNG state is left as it was.
    """
    derived = int(np.random.SeedSequence([seed, 1]).generate_state(1)[0])
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if device.type == "cuda":
            torch.manual_seed(derived)
        else:
            # torch.manual_seed would also queue a seed for every accelerator
            # not yet initialised (CUDA, XPU, MTIA), each recording a stack
            # trace (0.24 ms a message); a CPU round draws from this one only
            torch.default_generator.manual_seed(derived)
        yield


#: the step schedule's milestones, fractions of the rounds (Δ-SGD ICLR §4)
STEP_MILESTONES = (0.5, 0.75)


def round_lr(
    lr: float,
    decay: float,
    server_round: int,
    schedule: str = "constant",
    num_rounds: int = 1,
) -> float:
    """Return the client learning rate of round ``server_round`` (1-based).

    η_l·decay^(t−1): the per-round decay of DUA App. H.1 ("learning rate decay
    of 0.998", after FedExP's code, which multiplies η_l by 0.998 after each
    round). Round 0 (no round sent) counts as round 1.

    ``schedule="step"`` also divides by 10 for each milestone ⌊f·T⌋ (f in
    :data:`STEP_MILESTONES`, T = ``num_rounds``) that the 0-based round t − 1
    has reached: the Δ-SGD paper's ↓ baselines ("divided by 10 after 50%,
    and another by 10 after 75% of the total rounds", ICLR §4; its code
    decays at rounds int(0.5T)+1 and int(0.75T)+1). With T = 500, rounds
    1-250 train with η_l, 251-375 with η_l/10, 376-500 with η_l/100.
    """
    t = max(server_round - 1, 0)
    rate = lr * decay**t
    if schedule == "constant":
        return rate
    if schedule != "step":
        raise ValueError(f"unknown client-lr-schedule {schedule!r} (constant, step)")
    passed = sum(t >= math.floor(f * num_rounds) for f in STEP_MILESTONES)
    return rate / 10**passed


def one_message_process() -> bool:
    """Whether this process likely serves one message only (not a Ray actor).

    In deployment Flower starts a ClientApp process per message, so a node's
    data is worth writing as ready files (:mod:`fedadapt.tasks.ready_data`);
    a simulation's Ray actor keeps it in memory for all its messages and
    writes nothing (a sweep would otherwise copy the dataset per setting).
    Ray is never imported here.
    """
    ray = sys.modules.get("ray")
    return ray is None or not ray.is_initialized()


def partition_data(cfg: Mapping[str, Any], partition_id: int, num: int) -> ClientData:
    """Client ``partition_id``'s data, computed once per process and run config.

    A simulation actor answers many messages for the same nodes; the split
    is a pure function of the run config and the partition, so the cache is
    keyed by the whole run config (a run with other settings gets its own
    entry) and the partition. In a process that serves one message
    (:func:`one_message_process`: deployment) the data comes from the
    node's ready files, keyed by the same and by the files under
    ``data-dir`` (:func:`~fedadapt.tasks.ready_data.ready_client_data`); the
    first message writes them.
    """
    try:
        key = json.dumps(dict(cfg), sort_keys=True)
    except (TypeError, ValueError):  # not a plain run config: load it uncached
        return TASKS.get(cfg["task"]).load_client(cfg, partition_id, num)
    return _client_data(key, partition_id, num, one_message_process())


@lru_cache(maxsize=CLIENT_DATA_CACHE)
def _client_data(
    cfg_json: str, partition_id: int, num: int, ready: bool = False
) -> ClientData:
    cfg = json.loads(cfg_json)
    task = TASKS.get(cfg["task"])
    if not ready:
        return task.load_client(cfg, partition_id, num)
    files = tree_signature(cfg["data-dir"]) if "data-dir" in cfg else []
    what = {"run-config": cfg, "partition-id": partition_id,
            "num-partitions": num, "data-dir": files}  # fmt: skip
    return ready_client_data(
        f"{task.name}-{partition_id}-of-{num}",
        what,
        lambda: task.load_client(cfg, partition_id, num),
    )


def _model(cfg: Mapping[str, Any], state: Mapping[str, Any]) -> torch.nn.Module:
    model = TASKS.get(cfg["task"]).build_model()
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    return model


def client_data(
    cfg: Mapping[str, Any],
    partition_id: int,
    num_partitions: int,
    data_path: str | None = None,
    node_id: int | None = None,
) -> ClientData:
    """Return this node's data: its own files, else its partition of the task's.

    With a ``data_path`` (node-config ``data-path``) the node reads its own
    files (:func:`~fedadapt.tasks.node_data.load_node_data`, cached per
    process); data that is missing, unreadable or does not fit the task
    raises ValueError in one line naming the node and the path, which Flower
    returns to the server as this node's failed reply.
    """
    if data_path is None:
        return partition_data(cfg, partition_id, num_partitions)
    try:
        return load_node_data(data_path, cfg, ready=one_message_process())
    except NodeDataError as error:
        raise NodeDataError(error.path, error.problem, node_id) from None


def train_round(
    cfg: Mapping[str, Any],
    partition_id: int,
    num_partitions: int,
    global_state: Mapping[str, Any],
    lr: float,
    server_round: int,
    config: Mapping[str, Any] | None = None,
    local_arrays: Mapping[str, np.ndarray] | None = None,
    client_state: RecordDict | None = None,
    data_path: str | None = None,
    node_id: int | None = None,
) -> RoundResult:
    """Train the global model on this client's partition for one round.

    Metrics: ``train-loss``, ``train-accuracy``,
    ``num-examples``, ``update-sq-norm`` (‖x_i − x_t‖²), ``local-steps``,
    the optimizer's ``opt-*`` statistics (e.g. Δ-SGD's step sizes), and for
    the server's per-reply records (clients.jsonl) ``partition-id`` and
    ``train-time-s`` (wall seconds from receiving the model to the reply:
    data, training, state). The
    learning rate is decayed by run-config ``client-lr-decay`` per round
    and follows ``client-lr-schedule`` (:func:`round_lr`);
    ``client-weight-decay`` and ``client-grad-clip`` act on every local
    gradient (:func:`train_local`).

    ``config`` is the server's train config: when it names a local update
    (``local-update``), its client half
    (:mod:`fedadapt.client.local_update`) gets ``config``, the server's
    ``local_arrays``, the state it kept in ``client_state`` (the node's
    ``Context.state``, updated in place) and the round's optimizer, acts
    inside every local step, and adds its metrics and arrays
    (:attr:`RoundResult.local_arrays`) to the reply. Fed-LAMB/Fed-AMS's
    v̂ and v travel so (:mod:`fedadapt.client.fedlamb`).

    ``data_path`` (node-config ``data-path``): train on the node's own files
    instead of partition ``partition_id`` (:func:`client_data`).
    """
    started = time.perf_counter()
    task = TASKS.get(cfg["task"])
    data = client_data(cfg, partition_id, num_partitions, data_path, node_id)
    device = pick_device(cfg["device"])
    # dropout and any other draw of the global RNG: seeded per client round
    with client_rng(device, client_seed(cfg, server_round, partition_id)):
        model = _model(cfg, global_state).to(device)
        criterion = task.criterion()
        lr = round_lr(
            lr,
            cfg["client-lr-decay"],
            server_round,
            cfg["client-lr-schedule"],
            cfg["num-server-rounds"],
        )
        update = client_update(config or {})
        optimizer = OPTIMIZERS.get(cfg["client-optimizer"])(model, lr, cfg)
        reset = False
        if update is not None:
            kept, reset = load_client_state(client_state, update)
            update.begin(
                LocalStart(
                    model,
                    config or {},
                    local_arrays or {},
                    kept,
                    data.train,
                    criterion,
                    cfg["batch-size"],
                    device,
                    server_round,
                    lr,
                    state_reset=reset,
                    optimizer=optimizer,
                )
            )
        result = train_local(
            model,
            optimizer,
            criterion,
            data.train,
            epochs=cfg["local-epochs"],
            steps=cfg["local-steps"],
            batch_size=cfg["batch-size"],
            seed=client_seed(cfg, server_round, partition_id),
            device=device,
            classification=task.classification,
            weight_decay=cfg["client-weight-decay"],
            grad_clip=cfg["client-grad-clip"],
            local_update=update,
        )
        metrics: dict[str, float | int] = {
            "train-loss": result.loss,
            wire.NUM_EXAMPLES: result.num_examples,
            wire.UPDATE_SQ_NORM: result.update_sq_norm,
            "local-steps": result.steps,
            **result.optimizer_stats,
        }
        if result.accuracy is not None:
            metrics["train-accuracy"] = result.accuracy
        local = None
        if update is not None:
            end = update.end(model, result.steps)
            save_client_state(client_state, update, end.state)
            metrics.update(end.metrics)
            if reset:
                metrics[wire.LOCAL_STATE_RESET] = 1
            local = end.arrays or None
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    metrics[wire.PARTITION_ID] = partition_id  # who: for the per-reply records
    metrics[wire.TRAIN_TIME_S] = time.perf_counter() - started
    metrics[wire.TRAIN_DEVICE] = (device.index or 0) if device.type == "cuda" else -1
    age = process_age_s()
    if age is not None:
        metrics[wire.PROCESS_AGE_S] = age
    node = ray_node()
    if node is not None:
        metrics[wire.RAY_NODE] = node
    return RoundResult(state, metrics, local)


def ray_node() -> int | None:
    """Return the first 48 bits of the Ray node id this process runs on, or None.

    A simulated client runs in a Ray actor; which node of a cluster it ran
    on goes to clients.jsonl (``ray_node``), so a multi-node run can be
    checked. None outside Ray (deployment, tests); Ray is never imported here.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        return int(ray.get_runtime_context().get_node_id()[:12], 16)
    except Exception:  # noqa: BLE001 - a record, never a reason to fail a round
        return None


def evaluate_round(
    cfg: Mapping[str, Any],
    partition_id: int,
    num_partitions: int,
    global_state: Mapping[str, Any],
    data_path: str | None = None,
    node_id: int | None = None,
) -> dict[str, float | int]:
    """Evaluate the global model on this client's local test split.

    With ``data_path``: the node's own held-out split (:func:`client_data`).
    """
    task = TASKS.get(cfg["task"])
    data = client_data(cfg, partition_id, num_partitions, data_path, node_id)
    scores = evaluate_model(
        task,
        _model(cfg, global_state),
        data.test,
        cfg["batch-size"],
        pick_device(cfg["device"]),
    )
    metrics: dict[str, float | int] = {
        f"eval-{k}": v for k, v in scores.items() if k != "num-examples"
    }
    metrics[wire.NUM_EXAMPLES] = int(scores["num-examples"])
    return metrics
