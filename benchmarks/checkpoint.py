"""Checkpoint cost vs a round (issue #26 part 6: checkpoints by default).

Two measurements, each against a round measured in the same run:

1. **Real runs.** ``fedadapt simulate``'s machinery (a private SuperLink,
   Flower's Ray simulation) runs ``digits-mlp`` and ``mnist5k-cnn`` (both
   offline) with ``checkpoint-every=1``. The ServerApp records, per round,
   the round's wall time and the checkpoint's bytes and seconds
   (``rounds[i].checkpoint`` in results.json); rounds 2.. are used (round 1
   includes start-up), medians reported.
2. **Large models, no data needed.** ``save_checkpoint`` of the CIFAR
   ResNet-18 (11.2 M parameters) and ResNet-50 (23.7 M) of the CIFAR tasks,
   with a FedAdam-sized strategy state (two moment arrays per model array,
   as FedAdam/FedYogi/FedDuA keep), median of ``--repeats`` writes, against
   *one* client's local training of the Δ-SGD setup (500 samples, 1 epoch,
   batch 64, SGD) on random CIFAR-shaped data on this machine. A round
   trains at least one client, so the ratio is an upper bound of the cost
   per round on this hardware.

Usage (from the repository root)::

    .venv/bin/python benchmarks/checkpoint.py            # both parts
    .venv/bin/python benchmarks/checkpoint.py --no-runs  # part 2 only
    .venv/bin/python benchmarks/checkpoint.py --json out.json

Takes a few minutes on 2 CPU cores. Runs and checkpoints go to a temporary
folder in the system's temp dir, not the checkout; where that is a RAM disk
(tmpfs), point ``TMPDIR`` at a real disk, or the checkpoint times are a RAM
copy's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedadapt.client.training import train_local
from fedadapt.server.checkpoint import CHECKPOINT_FILE, save_checkpoint
from fedadapt.tasks import TASKS, pick_device

ROOT = Path(__file__).resolve().parents[1]


def real_run(task: str, nodes: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """Run ``task`` through a private SuperLink; return per-round medians."""
    from fedadapt.tools.submission import SimulationSuperLink, submit_run

    overrides = {
        "task": task,
        "num-server-rounds": rounds,
        "checkpoint-every": 1,
        "output-dir": str(workdir / "out"),
        "run-name": task,
    }
    with SimulationSuperLink(workdir / "flwr") as superlink:
        outcome = submit_run(superlink, ROOT, overrides, nodes, timeout=1800)
    if not outcome.ok or outcome.results is None:
        raise RuntimeError(f"{task}: run did not complete: {outcome}")
    data = json.loads(outcome.results.read_text())
    later = data["rounds"][1:]
    round_s = statistics.median(r["wall_time_s"] for r in later)
    ckpt_s = statistics.median(r["checkpoint"]["seconds"] for r in later)
    return {
        "task": task,
        "nodes": nodes,
        "rounds": rounds,
        "checkpoint_bytes": data["rounds"][-1]["checkpoint"]["bytes"],
        "checkpoint_s": ckpt_s,
        "round_s": round_s,
        "ratio": ckpt_s / round_s,
    }


def local_training_s(task: str, samples: int = 500, batch: int = 64) -> float:
    """Seconds of one client's local epoch (Δ-SGD setup) on random data."""
    torch.manual_seed(0)
    model = TASKS.get(task).build_model()
    classes = model.state_dict()[next(reversed(model.state_dict()))].shape[0]
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, 3, 32, 32), torch.randint(0, classes, (samples,))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    started = time.perf_counter()
    train_local(
        model, optimizer, torch.nn.CrossEntropyLoss(), data, epochs=1, steps=0,
        batch_size=batch, seed=0, device=pick_device("cpu"),
    )  # fmt: skip
    return time.perf_counter() - started


def large_model(task: str, repeats: int, workdir: Path) -> dict[str, Any]:
    """Checkpoint bytes/seconds of ``task``'s model + FedAdam-sized state."""
    torch.manual_seed(0)
    model = TASKS.get(task).build_model()
    arrays = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    moments = {k: np.zeros_like(v) for k, v in arrays.items() if v.dtype.kind == "f"}
    state = {"rule": {"m": moments, "v": {k: v + 1 for k, v in moments.items()}}}
    path = workdir / CHECKPOINT_FILE
    times, size = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        size = save_checkpoint(path, 1, arrays, state, {"config": {}, "rounds": []})
        times.append(time.perf_counter() - started)
    ckpt_s = statistics.median(times)
    train_s = local_training_s(task)
    return {
        "task": task,
        "parameters": sum(v.size for v in arrays.values()),
        "checkpoint_bytes": size,
        "checkpoint_s": ckpt_s,
        "one_client_epoch_s": train_s,
        "ratio": ckpt_s / train_s,
    }


def main() -> None:
    """Run the benchmark and print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-runs", action="store_true", help="skip part 1")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    out: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}",
    }
    with tempfile.TemporaryDirectory(prefix="fa-bench-") as tmp:
        work = Path(tmp)
        if not args.no_runs:
            out["runs"] = [
                real_run("digits-mlp", 10, 6, work / "digits"),
                real_run("mnist5k-cnn", 10, 4, work / "mnist5k"),
            ]
            print("| task | nodes | checkpoint | checkpoint time | round | ratio |")
            print("|---|---|---|---|---|---|")
            for r in out["runs"]:
                print(f"| {r['task']} | {r['nodes']} | "
                      f"{r['checkpoint_bytes'] / 1e3:.0f} kB | "
                      f"{r['checkpoint_s'] * 1e3:.1f} ms | {r['round_s']:.2f} s | "
                      f"{r['ratio']:.2%} |")  # fmt: skip
        out["large"] = [
            large_model(task, args.repeats, work)
            for task in ("cifar10-resnet18", "cifar100-resnet50")
        ]
    print("\n| model | parameters | checkpoint | checkpoint time "
          "| one client's epoch | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in out["large"]:
        print(f"| {r['task']} | {r['parameters'] / 1e6:.1f} M | "
              f"{r['checkpoint_bytes'] / 1e6:.0f} MB | {r['checkpoint_s']:.2f} s | "
              f"{r['one_client_epoch_s']:.1f} s | {r['ratio']:.2%} |")  # fmt: skip
    print(f"\n{out['machine']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
