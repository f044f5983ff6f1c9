"""What watching a run costs the run: the old supervisor against today's (#39).

``submit_run`` waits for a run's real outcome. It used to ask Flower for the
run's status (``flwr ls``, a Python process) at once, then every 2 s growing
to every 10 s, for the whole run, and to re-read results.json twice a
second; today it first asks after 5 s, not at all while the ServerApp is
writing results.json, and re-reads an unchanged file every 5 s. The old way
is today's code with ``RESULTS_QUIET_S`` and ``ORPHAN_CHECK_S`` set to 0
(nothing counts as progress, every look reads the file) and
``FIRST_STATUS_POLL_S`` 2 (the old way less its one ask at once).

The same ``fedadapt simulate`` cell is run with each, alternating (old, new,
old, new, ...), in this process; per run: its wall time, its median steady
round (results.json), its start-up (wall time minus rounds × median round:
also the end of the run), how many times Flower was asked and the CPU seconds
those ``flwr`` processes took (``RUSAGE_CHILDREN`` around each call: the
SuperLink and Ray are waited for only when the run ends, so they are not in
it). Run it on a quiet machine and state the load.

    .venv/bin/python benchmarks/supervisor_cost.py --rounds 150 --pairs 2 \\
        --json benchmarks/results/supervisor-cost.json
    # start-up of a suite's later cells: one cluster, short cells
    .venv/bin/python benchmarks/supervisor_cost.py --warm-cluster --rounds 6 \\
        --pairs 3 --json benchmarks/results/supervisor-cost-warm.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._output import write_json  # noqa: E402

#: the suite's mnist5k cell (conf/delta-sgd-fedprox-mnist5k.yaml, SGD), shorter
CELL = (
    "task='mnist5k-cnn' partition='delta-sgd' dirichlet-alpha=0.01 "
    "samples-per-client=500 client-test-fraction=0.0 clients-per-round=10 "
    "local-epochs=1 batch-size=64 strategy='fedavg' local-update='fedprox' "
    "fedprox.mu=0.01 evaluate-every=10 client-optimizer='sgd' client-lr=0.1"
)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(
    old: bool, rounds: int, out: Path, name: str, link: Any = None
) -> dict[str, Any]:
    """Run the cell once with the old or today's supervisor; its figures.

    Without ``link``: ``fedadapt simulate`` (its own SuperLink and Ray).
    With ``link`` (a running SimulationSuperLink on a running cluster):
    ``submit_run`` on it, as a suite's cell after its first.
    """
    from fedadapt.tools import cli, submission

    asks: list[float] = []
    real_flwr = submission.flwr

    def counted_flwr(args: list[str], env: dict[str, str], **kw: Any) -> str:
        before = _children_cpu()
        try:
            return real_flwr(args, env, **kw)
        finally:
            if args and args[0] == "ls":
                asks.append(_children_cpu() - before)

    constants = ("RESULTS_QUIET_S", "ORPHAN_CHECK_S", "FIRST_STATUS_POLL_S", "flwr")
    saved = {constant: getattr(submission, constant) for constant in constants}
    if old:
        submission.RESULTS_QUIET_S = submission.ORPHAN_CHECK_S = 0.0
        submission.FIRST_STATUS_POLL_S = 2.0
    submission.flwr = counted_flwr
    started = time.perf_counter()
    run_config = (
        f"{CELL} num-server-rounds={rounds} output-dir='{out}' run-name='{name}'"
    )
    try:
        if link is None:
            code = cli.main(
                ["simulate", "--app", str(ROOT), "--quiet", "--num-supernodes",
                 "100", "--run-config", run_config]
            )  # fmt: skip
        else:
            outcome = submission.submit_run(
                link, ROOT, cli._run_config(run_config), 100, 3600.0,
                federation_config="client-resources-num-cpus=1",
            )  # fmt: skip
            code = 0 if outcome.ok else 1
    finally:
        for constant, value in saved.items():
            setattr(submission, constant, value)
    wall = time.perf_counter() - started
    data = json.loads((out / name / "results.json").read_text())
    steady = [r["wall_time_s"] for r in data["rounds"][1:]]
    return {
        "supervisor": "old" if old else "new",
        "rc": code,
        "status": data["status"],
        "wall_s": round(wall, 1),
        "median_round_s": round(statistics.median(steady), 4),
        # what the run cost beyond its steady rounds: start-up and teardown
        "startup_s": round(wall - len(data["rounds"]) * statistics.median(steady), 1),
        "mean_round_s": round(statistics.mean(steady), 4),
        "flower_asked": len(asks),
        "flwr_ls_cpu_s": round(sum(asks), 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Alternate old and new runs; print each and the ratios; write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument(
        "--warm-cluster",
        action="store_true",
        help="run the cells on one private Ray cluster and SuperLink, after a "
        "first cell that is not counted (a suite's cells 2..n)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    # each ask as its own flwr process, whose CPU RUSAGE_CHILDREN counts (the
    # CLI helper's forked calls are its children, not ours): the asks' cost
    # as both supervisors paid it before the helper
    os.environ["FEDADAPT_FLWR_SUBPROCESS"] = "1"
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    runs = []
    with (
        tempfile.TemporaryDirectory(prefix="supervisor-cost-") as tmp,
        ExitStack() as stack,
    ):
        link = None
        if args.warm_cluster:
            from fedadapt.tools.deploy.ray_cluster import PrivateRayCluster
            from fedadapt.tools.submission import SimulationSuperLink

            cluster = stack.enter_context(
                PrivateRayCluster(
                    Path(tmp) / "ray", num_cpus=float(os.cpu_count() or 1)
                )
            )
            link = stack.enter_context(
                SimulationSuperLink(Path(tmp) / "home", ray_address=cluster.address)
            )
            one_run(False, args.rounds, Path(tmp), "first", link)  # not counted
        for pair in range(args.pairs):
            for old in (True, False):
                name = f"{'old' if old else 'new'}-{pair}"
                run = one_run(old, args.rounds, Path(tmp), name, link)
                run["load_after"] = round(os.getloadavg()[0], 2)
                runs.append(run)
                print(json.dumps(run), flush=True)

    def mean(who: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs if r["supervisor"] == who)

    def ratio(key: str) -> float:
        return round(mean("new", key) / mean("old", key), 3)

    summary = {
        "rounds": args.rounds,
        "warm_cluster": args.warm_cluster,
        "cores": len(os.sched_getaffinity(0)),
        "runs": runs,
        "new/old wall": ratio("wall_s"),
        "new/old start-up": ratio("startup_s"),
        "new/old mean round": ratio("mean_round_s"),
        "old flwr ls per run": mean("old", "flower_asked"),
        "new flwr ls per run": mean("new", "flower_asked"),
        "old flwr ls CPU s per run": round(mean("old", "flwr_ls_cpu_s"), 1),
        "new flwr ls CPU s per run": round(mean("new", "flwr_ls_cpu_s"), 1),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
