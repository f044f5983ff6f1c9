"""Message-API ServerApp: validates the run config, runs the strategy, records.

Everything is chosen by name through run-config (``task``, ``strategy``,
``client-optimizer``, ``partition``); an unknown name or invalid value fails
here, before any node is contacted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedadapt.config import ConfigError, validate_run_config
from fedadapt.registry import lookup
from fedadapt.server.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from fedadapt.server.results import RunRecorder, run_directory
from fedadapt.server.strategy_factory import build_strategy
from fedadapt.tasks import TASKS, Task, evaluate_model, pick_device

app = ServerApp()

EVAL_BATCH_SIZE = 512


def wait_for_nodes(grid: Grid, wanted: int, timeout: float) -> int:
    """Wait up to ``timeout`` s until ``wanted`` nodes are connected.

    Returns the number of connected nodes; raises ConfigError naming
    ``clients-per-round`` when too few connect in time.
    """
    deadline = time.monotonic() + timeout
    while True:
        connected = len(list(grid.get_node_ids()))
        if connected >= wanted:
            return connected
        if time.monotonic() >= deadline:
            raise ConfigError(
                "clients-per-round",
                f"{wanted} clients per round requested but only {connected} nodes "
                f"connected after {timeout:g}s",
            )
        time.sleep(0.5)


def check_names(cfg: Mapping[str, Any]) -> None:
    """Resolve every registry-backed key now, so a bad name fails at start."""
    for key in ("task", "strategy", "client-optimizer", "partition"):
        lookup(key).get(cfg[key])


def central_evaluator(task: Task, cfg: Mapping[str, Any]):  # noqa: ANN201
    """Return ``arrays -> metrics`` on the task's global test set."""
    test_set = task.load_test(cfg)
    device = pick_device(cfg["device"])
    model = task.build_model()

    def evaluate(arrays: ArrayRecord) -> dict[str, float]:
        model.load_state_dict(arrays.to_torch_state_dict())
        return evaluate_model(task, model, test_set, EVAL_BATCH_SIZE, device)

    return evaluate


def _numpy(arrays: ArrayRecord) -> dict[str, Any]:
    return {k: v.numpy() for k, v in arrays.items()}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` rounds and write results.json / curves.png."""
    cfg = validate_run_config(context.run_config)
    check_names(cfg)
    task = TASKS.get(cfg["task"])
    resume = load_checkpoint(cfg["resume-from"], cfg) if cfg["resume-from"] else None
    num_nodes = wait_for_nodes(grid, cfg["clients-per-round"], cfg["node-wait-timeout"])
    strategy = build_strategy(cfg, num_nodes)
    torch.manual_seed(cfg["seed"])
    initial = ArrayRecord(task.build_model().state_dict())
    first_round = 0
    if resume is not None:
        first_round = resume["round"]
        initial = ArrayRecord({k: Array(v) for k, v in resume["arrays"].items()})
        strategy.load_state_dict(resume["strategy"])  # type: ignore[attr-defined]
        strategy.round_offset = first_round  # type: ignore[attr-defined]
    evaluate = central_evaluator(task, cfg)

    run_dir = run_directory(cfg, context.run_id)
    recorder = RunRecorder(
        run_dir, cfg, context.run_id, previous=resume["results"] if resume else None
    )
    log(logging.INFO, "fedadapt: writing results to %s", recorder.run_dir)
    num_rounds = cfg["num-server-rounds"]
    every, ckpt_every = cfg["evaluate-every"], cfg["checkpoint-every"]

    def on_round_end(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == first_round:  # evaluation of the starting model
            if resume is None:
                recorder.record_initial(evaluate(arrays) if every else None)
            return None
        due = every > 0 and (server_round % every == 0 or server_round == num_rounds)
        scores = evaluate(arrays) if due else None
        reports = getattr(strategy, "round_reports", {})
        recorder.record_round(
            server_round, num_rounds, scores, reports.get(server_round, {})
        )
        if ckpt_every and (
            server_round % ckpt_every == 0 or server_round == num_rounds
        ):
            latest = getattr(strategy, "latest_arrays", None) or initial
            state = strategy.state_dict() if hasattr(strategy, "state_dict") else None
            save_checkpoint(
                run_dir / CHECKPOINT_FILE, server_round, _numpy(latest), state,
                recorder.data,
            )  # fmt: skip
        return MetricRecord(scores) if scores else None

    try:
        strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=num_rounds - first_round,
            timeout=cfg["round-timeout"],
            train_config=ConfigRecord({"lr": cfg["client-lr"]}),
            evaluate_config=ConfigRecord({}),
            evaluate_fn=on_round_end,
        )
    except BaseException as error:
        recorder.finish("failed", error=repr(error))
        raise
    recorder.finish("completed")
    log(logging.INFO, "fedadapt: results in %s", recorder.run_dir)
