"""A suite's wall time against the sum of its cells' plain-loop floors (#39).

Issue #39 item 3 asks that a whole suite (``conf/delta-sgd-fedprox-mnist5k.yaml``:
8 cells × 500 rounds) take at most 1.3× the sum of its cells' plain-loop
floors on the same cores. This measures each cell's floor and compares it
with a run of the suite that has finished:

* **floor of a cell**: the plain PyTorch loop of ``simulation_floor.py``
  (no Flower, no DataLoader; the cell's client optimizer and FedProx term,
  its clients, batch size and epochs) for ``--rounds`` rounds, in one
  process with every thread and in one one-thread process per core; the
  better, extrapolated to the suite's rounds: start-up + the mean training
  round × rounds + the evaluation's extra × evaluations.
* **the suite**: each cell's wall time from its results.json (``started`` to
  the last round's end) and the whole suite's from ``--suite-seconds`` (what
  ``time`` printed for ``fedadapt-exp run``).

    python benchmarks/suite_floor.py conf/delta-sgd-fedprox-mnist5k.yaml \\
        --suite-dir outputs/experiments/delta-sgd-fedprox-mnist5k \\
        --suite-seconds 3900 --json out.json

Timings are noisy on a shared machine: measure the floors right after the
suite, on the same machine, and state its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._output import write_json  # noqa: E402
from benchmarks.simulation_floor import floor  # noqa: E402
from fedadapt.config import validate_run_config  # noqa: E402
from fedadapt.tools.experiments import load_suite  # noqa: E402

#: run-config keys of a cell that only name where its output goes
OUTPUT_KEYS = ("output-dir", "run-name", "tracker-dir", "tracker-group")


def extrapolate(measured: dict[str, Any], rounds: int, every: int) -> float:
    """Seconds the plain loop would take for ``rounds`` rounds.

    ``measured`` is :func:`~benchmarks.simulation_floor.floor`'s summary of a
    shorter loop: its start-up, then the mean of its training-only rounds
    (round 1 left out: warm-up) per round, and the mean extra of its
    evaluation rounds once per evaluation.
    """
    times = measured["round_s"][1:]
    steps = range(2, len(measured["round_s"]) + 1)
    plain = [t for r, t in zip(steps, times, strict=True) if not every or r % every]
    evals = [t for r, t in zip(steps, times, strict=True) if every and r % every == 0]
    train = statistics.mean(plain)
    extra = statistics.mean(evals) - train if evals else 0.0
    evaluations = rounds // every if every else 0
    return measured["startup_s"] + rounds * train + evaluations * extra


def cell_seconds(results: Path) -> float:
    """A finished cell's wall time, as its results.json records it.

    ``wall_time_s`` (``started`` to the final write); a file older than that
    key falls back to its modification time, which a copy or a later
    rewrite of the file moves.
    """
    data = json.loads(results.read_text())
    if data.get("status") != "completed":
        raise SystemExit(f"{results}: status {data.get('status')!r}, not completed")
    if "wall_time_s" in data:
        return float(data["wall_time_s"])
    started = datetime.fromisoformat(data["started"])
    ended = datetime.fromtimestamp(results.stat().st_mtime, tz=started.tzinfo)
    return (ended - started).total_seconds()


def main(argv: list[str] | None = None) -> int:
    """Measure every cell's floor, compare with the suite's run, print, write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", type=Path, help="conf/<suite>.yaml")
    parser.add_argument("--suite-dir", type=Path, required=True)
    parser.add_argument("--suite-seconds", type=float, required=True)
    parser.add_argument("--rounds", type=int, default=20, help="floor rounds per cell")
    parser.add_argument(
        "--methods", help="only these methods' cells (as fedadapt-exp run --methods)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    suite = load_suite(args.suite)
    cores = len(os.sched_getaffinity(0))
    rows = []
    methods = set(args.methods.split(",")) if args.methods else None
    if methods is not None and (unknown := methods - set(suite.methods)):
        raise SystemExit(f"--methods: {sorted(unknown)} not in {sorted(suite.methods)}")
    for cell in suite.cells(args.suite_dir):
        if methods is not None and cell.method not in methods:
            continue
        overrides = {k: v for k, v in cell.overrides.items() if k not in OUTPUT_KEYS}
        cfg = validate_run_config({**overrides, "num-server-rounds": args.rounds})
        loops = {
            "threads": floor(cfg, suite.num_supernodes, args.rounds, 0, "cpu"),
            "processes": floor(cfg, suite.num_supernodes, args.rounds, cores, "cpu"),
        }
        every = cfg["evaluate-every"]
        estimates = {
            how: extrapolate(loop, suite.rounds, every) for how, loop in loops.items()
        }
        best = min(estimates, key=estimates.__getitem__)
        seconds = cell_seconds(args.suite_dir / cell.run_name / "results.json")
        rows.append(
            {
                "cell": cell.run_name,
                "floor_s": round(estimates[best], 1),
                "floor_loop": best,
                "floors": {k: round(v, 1) for k, v in estimates.items()},
                "cell_s": round(seconds, 1),
                "cell/floor": round(seconds / estimates[best], 2),
            }
        )
        print(
            f"{cell.run_name}: floor {estimates[best]:.0f} s ({best}), "
            f"cell {seconds:.0f} s, ×{seconds / estimates[best]:.2f}",
            flush=True,
        )
    floors = sum(r["floor_s"] for r in rows)
    cells = sum(r["cell_s"] for r in rows)
    summary = {
        "suite": suite.name,
        "cores": cores,
        "rounds": suite.rounds,
        "floor_rounds": args.rounds,
        "cells": rows,
        "sum_of_floors_s": round(floors, 1),
        "sum_of_cells_s": round(cells, 1),
        "methods": sorted(methods) if methods else "all",
        "suite_s": args.suite_seconds,
        "suite/floors": round(args.suite_seconds / floors, 2),
        "target": 1.3,
    }
    print("| cell | floor (s) | cell (s) | cell × floor |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['cell']} | {r['floor_s']:.0f} | {r['cell_s']:.0f} "
              f"| {r['cell/floor']:.2f} |")  # fmt: skip
    print(f"| **suite** | {floors:.0f} | {args.suite_seconds:.0f} "
          f"| **{args.suite_seconds / floors:.2f}** (target ≤ 1.3) |")  # fmt: skip
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
