"""Tracker cost vs a simulated round (issue #32: at most 5 % of a round).

Two measurements, both against rounds measured in the same run:

1. **Real runs, tracker on vs off.** ``fedadapt simulate``'s machinery (one
   private SuperLink, Flower's Ray simulation) runs ``digits-mlp`` (offline,
   the cheapest round we have: the worst case for a fixed per-round cost)
   once per tracker: none, tensorboard, wandb, mlflow (those installed).
   A round's ``wall_time_s`` in results.json runs from the end of the
   previous round's record, so it includes the tracker's logging of that
   round. Median over rounds 2.. (round 1 includes start-up); ratio against
   ``tracker=none``. On a shared machine this A/B is as noisy as the load.
2. **The tracker alone.** The ``tracker=none`` run's own round entries are
   fed to each tracker as :class:`RunRecorder` feeds them (``round_metrics``
   then ``log_round``, timed); the median is the tracker's cost per round,
   divided by that run's median (and fastest) round. Round-for-round the
   same records, so this isolates the tracker from the simulation's noise.
   Between rounds the replay waits ``--pause`` seconds, as a server waits
   for its clients: work a tracker does in the background (MLflow's
   asynchronous batches) then happens there, as in a real run, and the
   figure is the time a round is delayed by.

Usage (from the repository root)::

    .venv/bin/python benchmarks/tracking.py [--rounds 12] [--pause 0.2] \\
        [--json out.json]

Takes a few minutes on 2 CPU cores. Runs go to a temporary folder in the
system's temp dir (``TMPDIR``), not the checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fedadapt.config import validate_run_config
from fedadapt.server.tracking import MODULES, open_tracker, round_metrics

ROOT = Path(__file__).resolve().parents[1]
NODES = 10


def installed_trackers() -> list[str]:
    """The trackers whose package is importable here."""
    return [t for t, m in MODULES.items() if importlib.util.find_spec(m) is not None]


def real_runs(trackers: list[str], rounds: int, work: Path) -> dict[str, Any]:
    """Run digits-mlp once per tracker on one SuperLink; per-round medians."""
    from fedadapt.tools.submission import SimulationSuperLink, submit_run

    found: dict[str, Any] = {}
    with SimulationSuperLink(work / "flwr") as superlink:
        for tracker in ["none", *trackers]:
            overrides = {
                "task": "digits-mlp",
                "num-server-rounds": rounds,
                "output-dir": str(work / "out"),
                "run-name": tracker,
                "tracker": tracker,
            }
            outcome = submit_run(superlink, ROOT, overrides, NODES, timeout=1800)
            if not outcome.ok or outcome.results is None:
                raise RuntimeError(f"tracker={tracker}: run did not complete")
            data = json.loads(outcome.results.read_text())
            if "tracker_error" in data:
                raise RuntimeError(f"tracker={tracker}: {data['tracker_error']}")
            found[tracker] = data
    return found


def replay(data: dict[str, Any], tracker: str, work: Path, pause: float) -> list[float]:
    """Seconds the tracker adds to each of ``data``'s rounds.

    The recorder's own call, timed alone: :func:`round_metrics` of the round
    entry and the tracker's ``log_round``; every round entry of the real run,
    one after the other, ``pause`` seconds apart.
    """
    cfg = validate_run_config({"tracker": tracker, "output-dir": str(work)})
    run_dir = work / f"replay-{tracker}"
    run_dir.mkdir(parents=True)
    backend = open_tracker(cfg, run_dir)
    assert backend is not None
    backend.log_config(cfg)
    times = []
    for entry in data["rounds"]:
        started = time.perf_counter()
        backend.log_round(entry["round"], round_metrics(entry))
        times.append(time.perf_counter() - started)
        time.sleep(pause)  # the server waiting for its clients
    backend.close("completed")
    return times


def main() -> None:
    """Run both parts and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--pause", type=float, default=0.2, help="s between rounds")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    trackers = installed_trackers()
    out: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "task": "digits-mlp",
        "nodes": NODES,
        "rounds": args.rounds,
        "trackers": {},
    }
    with tempfile.TemporaryDirectory(prefix="fa-bench-") as tmp:
        work = Path(tmp)
        runs = real_runs(trackers, args.rounds, work)

        def median_round(tracker: str) -> float:
            later = runs[tracker]["rounds"][1:]
            return statistics.median(r["wall_time_s"] for r in later)

        base_round = median_round("none")
        untracked = [r["wall_time_s"] for r in runs["none"]["rounds"][1:]]
        fastest = min(untracked)  # the worst case for a fixed per-round cost

        for tracker in trackers:
            extra = statistics.median(replay(runs["none"], tracker, work, args.pause))
            out["trackers"][tracker] = {
                "round_s": median_round(tracker),
                "round_ratio": median_round(tracker) / base_round,
                "tracker_s_per_round": extra,
                "tracker_share": extra / base_round,
                "tracker_share_of_fastest_round": extra / fastest,
            }
    out["round_s_untracked"] = base_round
    out["rounds_s_untracked"] = untracked
    print(f"{out['machine']}; digits-mlp, {NODES} nodes, {args.rounds} rounds")
    print(
        f"untracked round: median {base_round * 1000:.1f} ms, fastest "
        f"{min(out['rounds_s_untracked']) * 1000:.1f} ms (rounds 2..)"
    )
    print(
        "| tracker | round | on/off | tracker per round | share of the median "
        "round | share of the fastest round |"
    )
    print("|---|---|---|---|---|---|")
    for tracker, row in out["trackers"].items():
        print(
            f"| {tracker} | {row['round_s'] * 1000:.1f} ms | "
            f"{row['round_ratio']:.3f} | {row['tracker_s_per_round'] * 1000:.2f} ms | "
            f"{row['tracker_share'] * 100:.2f} % | "
            f"{row['tracker_share_of_fastest_round'] * 100:.2f} % |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
