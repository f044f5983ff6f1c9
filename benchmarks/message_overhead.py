"""Per-message overhead of fedadapt's ClientApp and strategy (issue #30).

With 1,000 clients × 50 samples (100 per round) fedadapt's simulated round
was 2.04× the minimal Flower app's while local training was 1.12× the plain
loop: the difference is per message. This measures it in one process, no
Flower loop: the strategy's ``configure_train`` builds a round's real Flower
train Messages (mnist5k-cnn, Δ-SGD partition, 50 samples per client, 100 of
1,000 nodes), then, each repeated and timed in process CPU time:

* **fedadapt client**: ``fedadapt.client.client_app.train`` on every message
  (run-config validation, records <-> state dicts, the client round);
* **train_round**: ``fedadapt.client.local.train_round`` on the same
  clients with the state dict converted once (fedadapt's local work alone);
* **minimal client**: ``benchmarks/minimal_app``'s ``train_fn`` on the same
  messages (same model, its own data of 50 samples, no fedadapt);
* **fedadapt server**: the strategy's ``aggregate_train`` on the 100 replies
  (screening, traffic records, FedAvg), against Flower's own ``FedAvg``'s
  ``aggregate_train`` on the minimal app's replies;

prints per-message milliseconds and ratios measured in this run, and a
SHA-256 of the first replies (update arrays and metrics less
``train-time-s``) against :data:`DIGEST`, the digest before #30's
per-message changes: a change that alters any number shows ``DIFFERS``.

    python benchmarks/message_overhead.py                 # ~1 min on 2 cores
    python benchmarks/message_overhead.py --profile 25    # + cProfile, top 25
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "minimal_app"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from benchmarks._protocols import SGD_MNIST5K  # noqa: E402
from fedadapt.client import client_app  # noqa: E402
from fedadapt.client.local import _model, client_rng, train_round  # noqa: E402
from fedadapt.config import validate_run_config  # noqa: E402
from fedadapt.server.strategy_factory import build_strategy  # noqa: E402
from fedadapt.strategies import wire  # noqa: E402
from fedadapt.tasks import TASKS  # noqa: E402

#: SHA-256 of the first DIGEST_REPLIES replies before the per-message changes
DIGEST = "114c50e5dbef45fc"  # first 16 hex digits
DIGEST_REPLIES = 5

#: the simulation floor's mnist5k cell with 10 × the clients, each 1/10 the
#: data (1,000 × 50 samples), 100 per round
RUN_CONFIG: dict[str, Any] = {
    **SGD_MNIST5K,
    "samples-per-client": 50,
    "clients-per-round": 100,
    "device": "cpu",
}


class Grid:
    """The nodes a strategy samples from (no messages are sent)."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def contexts(num: int, run_config: dict[str, Any]) -> dict[int, Context]:
    return {
        node: Context(
            1,
            node,
            {"partition-id": node - 1, "num-partitions": num},
            RecordDict(),
            dict(run_config),
        )
        for node in range(1, num + 1)
    }


def digest(replies: list[Message]) -> str:
    """SHA-256 of the replies' arrays and metrics (train-time-s left out)."""
    h = hashlib.sha256()
    for reply in replies:
        for name, record in sorted(reply.content.array_records.items()):
            for key, array in record.items():
                h.update(f"{name}/{key}".encode())
                h.update(np.ascontiguousarray(array.numpy()).tobytes())
        for name, record in sorted(reply.content.metric_records.items()):
            for key, value in sorted(record.items()):
                if key != wire.TRAIN_TIME_S:
                    h.update(f"{name}/{key}={value!r}".encode())
    return h.hexdigest()


def _enter(manager: Any) -> None:
    with manager:
        pass


def cpu_per_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Least over ``repeats`` of process CPU ms per call of ``fn`` (``calls`` each).

    The least disturbed repeat: on a shared machine other jobs only add.
    """
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) / calls * 1e3)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, help="top N of cProfile")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from flwr.supercore.task_identity import TaskIdentity

    # Messages built outside a run need a run identity (Flower sets it in one)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    from minimal_app import client_app as minimal_client  # type: ignore[import-not-found]

    run_config = dict(RUN_CONFIG, **{"num-server-rounds": 10})
    cfg = validate_run_config(run_config)
    ctx = contexts(args.nodes, run_config)
    strategy = build_strategy(cfg, args.nodes)
    torch.manual_seed(0)
    random.seed(0)  # Flower samples with the module RNG: the same 100 nodes each run
    model = TASKS.get(cfg["task"]).build_model()
    messages = list(
        strategy.configure_train(
            1,
            ArrayRecord(model.state_dict()),
            ConfigRecord({wire.LR: cfg["client-lr"]}),
            Grid(list(ctx)),
        )
    )
    n = len(messages)
    nodes = [m.metadata.dst_node_id for m in messages]
    print(f"{cfg['task']}: {n} train messages to {args.nodes} nodes, 50 samples each")

    def fedadapt_clients() -> list[Message]:
        return [client_app.train(m, ctx[m.metadata.dst_node_id]) for m in messages]

    state = messages[0].content[wire.ARRAYS].to_torch_state_dict()

    def local_rounds() -> None:
        for node in nodes:
            train_round(cfg, node - 1, args.nodes, state, cfg["client-lr"], 1)

    mini_ctx = contexts(args.nodes, {**run_config, "device": "cpu"})

    def minimal_clients() -> list[Message]:
        return [
            minimal_client.train_fn(m, mini_ctx[m.metadata.dst_node_id])
            for m in messages
        ]

    replies = fedadapt_clients()  # warm: data caches, first-call imports
    mini_replies = minimal_clients()
    local_rounds()
    got = digest(replies[:DIGEST_REPLIES])
    same = "same" if got.startswith(DIGEST) else "DIFFERS"
    print(f"digest of the first {DIGEST_REPLIES} replies: {got[:16]}… ({same})")

    # aggregate_train needs the strategy's round state: configure before each
    def fedadapt_server() -> None:
        strategy.configure_train(
            1,
            ArrayRecord(model.state_dict()),
            ConfigRecord({wire.LR: cfg["client-lr"]}),
            Grid(list(ctx)),
        )
        strategy.aggregate_train(1, replies)

    flower = FedAvg(fraction_train=n / args.nodes, min_available_nodes=2)

    def flower_server() -> None:
        flower.configure_train(
            1, ArrayRecord(model.state_dict()), ConfigRecord(), Grid(list(ctx))
        )
        flower.aggregate_train(1, mini_replies)

    rows = {
        "fedadapt client (ClientApp train)": cpu_per_call(
            fedadapt_clients, n, args.repeats
        ),
        "fedadapt train_round alone": cpu_per_call(local_rounds, n, args.repeats),
        "minimal app client (train_fn)": cpu_per_call(minimal_clients, n, args.repeats),
        "fedadapt server (configure + aggregate)": cpu_per_call(
            fedadapt_server, n, args.repeats
        ),
        "Flower FedAvg server (configure + aggregate)": cpu_per_call(
            flower_server, n, args.repeats
        ),
    }
    for name, ms in rows.items():
        print(f"  {name:46s} {ms:8.3f} ms CPU per message")
    print("  components (ms CPU per call, each alone):")
    record = messages[0].content[wire.ARRAYS]
    trained = replies[0].content[wire.ARRAYS].to_torch_state_dict()
    device = torch.device("cpu")
    parts: dict[str, Callable[[], Any]] = {
        "validate_run_config": lambda: validate_run_config(run_config),
        "ArrayRecord -> state dict (Flower)": record.to_torch_state_dict,
        "state dict -> ArrayRecord (Flower)": lambda: ArrayRecord(trained),
        "  ours: client_app._state_dict": lambda: client_app._state_dict(record),
        "  ours: client_app._record": lambda: client_app._record(
            {k: v.numpy() for k, v in trained.items()}
        ),
        "client_rng (seed + restore torch RNG)": lambda: _enter(client_rng(device, 1)),
        "build model + load state": lambda: _model(cfg, state),
    }
    for name, part in parts.items():
        ms = cpu_per_call(lambda part=part: [part() for _ in range(n)], n, args.repeats)
        print(f"    {name:44s} {ms:8.3f}")
    values = list(rows.values())
    print(f"  client: fedadapt / minimal      {values[0] / values[2]:.3f}")
    print(f"  client: ClientApp / train_round {values[0] / values[1]:.3f}")
    print(f"  client: wrapper overhead        {values[0] - values[1]:.3f} ms")
    print(f"  server: fedadapt / Flower FedAvg {values[3] / values[4]:.3f}")
    total_f, total_m = values[0] + values[3], values[2] + values[4]
    print(f"  per message, client + server: fedadapt / minimal {total_f / total_m:.3f}")
    if args.profile:
        for name, fn in (("client", fedadapt_clients), ("server", fedadapt_server)):
            profiler = cProfile.Profile()
            profiler.runcall(fn)
            print(f"\ncProfile, fedadapt {name}, {n} messages (tottime):")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
