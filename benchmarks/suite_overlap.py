"""A suite's cells on one cluster: wait for Flower's end, or overlap it (#39).

When a cell's ServerApp has written its results, Flower's ``flwr-simulation``
process still shuts down for a few seconds (its threads notice the stop
within a second, then it leaves the Ray cluster) before Flower reports the
run finished. ``fedadapt-exp run`` used to start a slot's next cell only
then; today it starts it as soon as the cell's results.json says it ended
(``submit_run``'s ``on_ended``), and the next cell's submission and
process start overlap that shutdown.

The same small suite (short cells of ``--task``) is run both ways on one Ray
cluster started here (``--ray-address``, as a suite on a running cluster),
alternating (waiting, overlapping, waiting, ...), in this process. Per
suite: its wall time and its overhead per cell (wall time minus every
cell's rounds × its median steady round, over the cells: the suite's own
start and end included) and each later cell's start-up as the suite sees
it (from the previous cell's end, by results.json, to its own end, less its
rounds × its median steady round). The waiting way
is today's code with ``on_ended`` withheld. Run it on a quiet machine and
state the load.

    .venv/bin/python benchmarks/suite_overlap.py --pairs 2 \\
        --json benchmarks/results/suite-overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._output import write_json  # noqa: E402

SUITE = """
name: overlap
description: short cells, one after another on one cluster
num-supernodes: {nodes}
rounds: {rounds}
seeds: {seeds}
metric: eval-loss
base: {base}
methods:
  sgd: {{client-optimizer: sgd, client-lr: 0.1}}
  adam: {{client-optimizer: adam, client-lr: 0.01}}
"""
#: task -> (nodes, the suite's base): digits-mlp every node every round;
#: mnist5k-cnn the Δ-SGD protocol's 100 nodes, 10 a round (seeded sampling
#: asks every node its partition before round 1)
TASKS = {
    "digits-mlp": (
        10,
        "{task: digits-mlp, clients-per-round: 0, local-epochs: 0, local-steps: 10}",
    ),
    "mnist5k-cnn": (
        100,
        "{task: mnist5k-cnn, partition: delta-sgd, dirichlet-alpha: 0.01, "
        "samples-per-client: 500, client-test-fraction: 0.0, "
        "clients-per-round: 10, local-epochs: 1, batch-size: 64}",
    ),
}


def one_suite(way: str, suite: Path, out: Path, address: str) -> dict[str, Any]:
    """Run the suite once: ``overlap`` (today), or ``wait`` / ``program``."""
    from fedadapt.tools import experiments, submission
    from fedadapt.tools.deploy import flwr_cli

    real, end_poll = submission.submit_run, submission.END_POLL_S

    def waiting(*args: Any, on_ended: Any = None, **kwargs: Any) -> Any:
        return real(*args, **kwargs)  # the slot is freed only on Flower's word

    flwr_cli.close()  # each suite starts its own CLI helper, as a command does
    if way == "wait":
        submission.submit_run = waiting  # type: ignore[assignment]
    if way == "program":  # before the CLI helper and the 0.1-s look at the end
        os.environ[flwr_cli.SUBPROCESS_ENV] = "1"
        submission.END_POLL_S = submission.RESULTS_POLL_S
    started = time.perf_counter()
    try:
        code = experiments.main(
            ["run", str(suite), "--output", str(out), "--ray-address", address]
        )
    finally:
        submission.submit_run = real  # type: ignore[assignment]
        submission.END_POLL_S = end_poll
        os.environ.pop(flwr_cli.SUBPROCESS_ENV, None)
        flwr_cli.close()
    wall = time.perf_counter() - started
    cells = sorted(
        (_cell_times(json.loads(path.read_text())) for path in
         (out / "overlap").glob("*/results.json")),
        key=lambda cell: cell["end"],
    )  # fmt: skip
    later = [_later_cell(cells[k - 1], cells[k]) for k in range(1, len(cells))]
    rounds_time = sum(cell["rounds"] for cell in cells)
    return {
        "way": way,
        "rc": code,
        "cells": len(cells),
        "wall_s": round(wall, 1),
        "overhead_per_cell_s": round((wall - rounds_time) / len(cells), 2),
        "later_cells": later,
        "load_after": round(os.getloadavg()[0], 2),
    }


def _cell_times(data: dict[str, Any]) -> dict[str, float]:
    """A cell's moments and parts, from its results.json (seconds).

    results.json's ``started`` and ``wall_time_s`` count from the recorder's
    start, a step of the ServerApp's start-up (``startup``, in order);
    round 1 from the end of the initial evaluation, the last step.
    """
    times = [r["wall_time_s"] for r in data["rounds"]]
    steady = statistics.median(times[1:])
    steps = dict(data["startup"])
    to_main = steps.pop("process_to_main")
    names = list(steps)
    before = sum(steps[k] for k in names[: names.index("recorder")])
    after = sum(steps.values()) - before
    recorder_at = datetime.fromisoformat(data["started"]).timestamp()
    return {
        "process_start": recorder_at - before - to_main,
        "to_main": to_main,
        "steps": before + after,
        "first_round_extra": times[0] - steady,
        # rounds 2..N against the median (evaluation rounds, noise)
        "rounds_spread": sum(times[1:]) - (len(times) - 1) * steady,
        "rounds": len(times) * steady,
        "end": recorder_at + data["wall_time_s"],
        # after the last round: final evaluation, plots, the last write
        "finish": data["wall_time_s"] - after - sum(times),
    }


def _later_cell(before: dict[str, float], cell: dict[str, float]) -> dict[str, float]:
    """A later cell's start-up as the suite sees it, part by part (seconds):
    from the previous cell's end (its last write) to its own, less its
    rounds × its median steady round. The parts add up to it."""
    parts = {
        "previous_end_to_process": cell["process_start"] - before["end"],
        "process_to_main": cell["to_main"],
        "serverapp_steps": cell["steps"],
        "first_round_extra": cell["first_round_extra"],
        "rounds_spread": cell["rounds_spread"],
        "finish": cell["finish"],
    }
    parts["startup"] = cell["end"] - before["end"] - cell["rounds"]
    return {k: round(v, 2) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> int:
    """Alternate the two ways; print each suite and the ratios; write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="digits-mlp")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=3, help="cells = 2 × seeds")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument(
        "--baseline",
        choices=("wait", "program"),
        default="wait",
        help="wait: a slot's next cell starts when Flower reports the last one "
        "finished; program: it overlaps Flower's end, but each flwr call is a "
        "new Python process and results.json is looked at every 0.5 s to the "
        "end (before the CLI helper)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    baseline = args.baseline
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    from fedadapt.tools.deploy.ray_cluster import PrivateRayCluster

    runs = []
    with tempfile.TemporaryDirectory(prefix="suite-overlap-") as tmp:
        suite = Path(tmp) / "overlap.yaml"
        seeds = list(range(args.seeds))
        nodes, base = TASKS[args.task]
        suite.write_text(
            SUITE.format(nodes=nodes, base=base, rounds=args.rounds, seeds=seeds)
        )
        cpus = float(len(os.sched_getaffinity(0)))
        with PrivateRayCluster(Path(tmp) / "ray", num_cpus=cpus) as cluster:
            for pair in range(args.pairs):
                for way in (baseline, "overlap"):
                    out = Path(tmp) / f"{way}-{pair}"
                    run = one_suite(way, suite, out, cluster.address)
                    runs.append(run)
                    print(json.dumps(run), flush=True)

    def mean(way: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs if r["way"] == way)

    def median_parts(way: str) -> dict[str, float]:
        found = [c for r in runs if r["way"] == way for c in r["later_cells"]]
        return {k: round(statistics.median(c[k] for c in found), 2) for k in found[0]}

    summary = {
        "task": args.task,
        "rounds": args.rounds,
        "cells": 2 * args.seeds,
        "cores": len(os.sched_getaffinity(0)),
        "runs": runs,
        "baseline": baseline,
        f"overlap/{baseline} wall": round(
            mean("overlap", "wall_s") / mean(baseline, "wall_s"), 3
        ),
        f"{baseline} overhead per cell s": round(
            mean(baseline, "overhead_per_cell_s"), 2
        ),
        "overlap overhead per cell s": round(mean("overlap", "overhead_per_cell_s"), 2),
        f"{baseline}: a later cell's start-up, medians (s)": median_parts(baseline),
        "overlap: a later cell's start-up, medians (s)": median_parts("overlap"),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.json:
        write_json(args.json, summary)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
