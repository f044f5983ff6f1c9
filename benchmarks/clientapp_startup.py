"""#40 item 3: what one train message costs a fresh ``flwr-clientapp`` process.

In deployment Flower starts a new ClientApp process for every message, so a
round's client time is mostly start-up: Python, flwr, torch, fedadapt's
modules, the node's data and the first optimizer step. This script times
those phases in a fresh subprocess each time, as a SuperNode of ``fedadapt
deploy`` sees them (digits-mlp, the app's default run config,
``partition-id=0 num-partitions=3``), for one or more checkouts of fedadapt
(``--repo``: the current tree and, say, an old commit's worktree), best of
``--repeats`` per phase. Each checkout first handles one message untimed
(a node's first message writes what later ones read: the partition, and
here the node's ready data file), in its own cache folder.

Phases (seconds, in the child process unless said otherwise):

``python``        interpreter start-up and exit (parent's wall time minus the
                  child's phases)
``flwr``          ``import flwr.app, flwr.clientapp``
``torch``         ``import torch``
``client_app``    ``import fedadapt.client.client_app`` (flwr, torch loaded)
``data``          the node's data (:func:`fedadapt.client.local.client_data`)
``train``         ``client_app.train(message, context)``: model, optimizer,
                  local epochs, the reply (data already loaded)
``total``         the parent's wall time of the whole process

The node's first message (which writes what later ones read) is printed
apart, one sample.

whether ``torch._dynamo`` was imported by the end, and how many modules
(and which top-level packages) the message itself imported (data + train).

Run: ``python benchmarks/clientapp_startup.py --repo . --repo ../old``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OPTIMIZERS = ("sgd", "delta-sgd")
PHASES = ("python", "flwr", "torch", "client_app", "data", "train", "total")

CHILD = r"""
import json, sys, time
t = time.perf_counter
out = {}
s = t(); import flwr.app, flwr.clientapp; out["flwr"] = t() - s
s = t(); import torch; out["torch"] = t() - s
s = t(); from fedadapt.client import client_app; out["client_app"] = t() - s
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType
from fedadapt.client.local import client_data
from fedadapt.config import validate_run_config
from fedadapt.strategies import wire
from fedadapt.tasks import TASKS
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
run_config = {"task": "digits-mlp", "client-optimizer": sys.argv[1]}
node_config = {"partition-id": 0, "num-partitions": 3}
cfg = validate_run_config(run_config)
before = set(sys.modules)
s = t(); data = client_data(cfg, 0, 3); out["data"] = t() - s
torch.manual_seed(0)
state = TASKS.get("digits-mlp").build_model().state_dict()
content = RecordDict({
    wire.ARRAYS: ArrayRecord(state),
    wire.CONFIG: ConfigRecord({wire.LR: 0.05, wire.SERVER_ROUND: 1}),
})
msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
context = Context(1, 1, node_config, RecordDict(), run_config)
s = t(); reply = client_app.train(msg, context); out["train"] = t() - s
out["dynamo"] = "torch._dynamo" in sys.modules
loaded = set(sys.modules) - before
out["modules"] = len(loaded)
out["packages"] = sorted({m.split(".")[0] for m in loaded if not m.startswith("_")})
out["samples"] = len(data.train)
print("RESULT " + json.dumps(out))
"""


def one_process(repo: Path, optimizer: str, cache: Path) -> dict[str, Any]:
    """Handle one train message in a fresh process; return its phases."""
    env = dict(os.environ, PYTHONPATH=str(repo), FEDADAPT_CACHE_DIR=str(cache))
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, optimizer],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    total = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{repo}: child failed:\n{done.stderr}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    inside = sum(result[p] for p in PHASES[1:-1])
    return {**result, "python": total - inside, "total": total}


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase the smallest time over the runs (flags from the first run)."""
    best = {p: min(r[p] for r in runs) for p in PHASES}
    flags = ("dynamo", "samples", "modules", "packages")
    return {**best, **{k: runs[0][k] for k in flags}}


def main(argv: list[str] | None = None) -> int:
    """Time the phases for each ``--repo`` and print them with ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repo", type=Path, action="append", help="a fedadapt checkout (repeatable)"
    )
    parser.add_argument("--optimizer", action="append", choices=OPTIMIZERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    repos = [r.resolve() for r in (args.repo or [Path(".")])]
    optimizers = args.optimizer or list(OPTIMIZERS)
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="clientapp-startup-") as tmp:
        firsts = {}
        for index, repo in enumerate(repos):
            cache = Path(tmp) / f"cache-{index}"
            for optimizer in optimizers:  # the node's first message (one sample)
                firsts[index, optimizer] = one_process(repo, optimizer, cache)
        # interleaved, so load drifts touch every checkout alike
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for index, repo in enumerate(repos):
                for optimizer in optimizers:
                    cache = Path(tmp) / f"cache-{index}"
                    sample = one_process(repo, optimizer, cache)
                    runs.setdefault((index, optimizer), []).append(sample)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"best of {args.repeats}, seconds")  # fmt: skip
    header = f"{'checkout':<28} {'optimizer':<10} " + " ".join(
        f"{p:>10}" for p in PHASES
    )
    print(header + "   dynamo  modules")
    for (index, optimizer), got in runs.items():
        best = best_of(got)
        first = {p: firsts[index, optimizer][p] for p in ("data", "train", "total")}
        figures.setdefault(str(repos[index]), {})[optimizer] = {
            **best, "first-message": first}  # fmt: skip
        cells = " ".join(f"{best[p]:10.3f}" for p in PHASES)
        name = str(repos[index])[-28:]
        print(f"{name:<28} {optimizer:<10} {cells}   {best['dynamo']!s:<6}  "
              f"{best['modules']} {' '.join(best['packages'])[:60]}")  # fmt: skip
    print("the node's first message (one sample): data, train, total")
    for (index, optimizer), first in firsts.items():
        cells = " ".join(f"{first[p]:10.3f}" for p in ("data", "train", "total"))
        print(f"{str(repos[index])[-28:]:<28} {optimizer:<10} {cells}")
    if len(repos) > 1:
        base = figures[str(repos[-1])]
        print(f"ratio last checkout / each (>1: faster than {repos[-1].name})")
        for repo in repos[:-1]:
            for optimizer in optimizers:
                new = figures[str(repo)][optimizer]
                cells = " ".join(
                    f"{base[optimizer][p] / max(new[p], 1e-9):10.2f}" for p in PHASES
                )
                print(f"{str(repo)[-28:]:<28} {optimizer:<10} {cells}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
