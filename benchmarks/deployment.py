"""Round wall time: Ray simulation vs processes vs containers, and what TLS adds.

Runs the same app and config (digits-mlp, 3 clients, FedAvg, a few local
steps, central evaluation each round) in each mode, reads every round's wall
time from results.json, and prints the median of the steady rounds (round 1
excluded: it pays for Ray's start in simulation) with the ratio against the
simulation measured in the same run. Writes JSON to --output.

    .venv/bin/python benchmarks/deployment.py [--rounds 4] [--no-containers]

Containers need an engine and the image (docker/engine.sh up; the image is
built as docs/docker.md shows, tag given by --image); without them that mode
is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedadapt.cli import SimulationSuperLink, submit_run  # noqa: E402
from fedadapt.deploy.local import LocalDeployment  # noqa: E402

CONFIG = {
    "task": "digits-mlp",
    "strategy": "fedavg",
    "clients-per-round": 3,
    "local-steps": 10,
    "evaluate-every": 1,
}


def _round_times(outcome, rounds: int) -> dict:
    if not outcome.ok:
        raise RuntimeError(f"run failed: {outcome.status} {outcome.problems}")
    data = json.loads(outcome.results.read_text())
    times = [r["wall_time_s"] for r in data["rounds"]]
    assert len(times) == rounds
    return {
        "round_s": times,
        "first_round_s": times[0],
        "median_round_s": statistics.median(times[1:]),
        "run_s": outcome.wall_time_s,
    }


def simulation(work: Path, rounds: int) -> dict:
    """Flower's Ray simulation via a private simulation SuperLink."""
    with SimulationSuperLink(work / "sim") as link:
        cfg = {**CONFIG, "num-server-rounds": rounds, "output-dir": str(work / "o1")}
        return _round_times(submit_run(link, ROOT, cfg, 3, 900), rounds)


def processes(work: Path, rounds: int, tls: bool, auth: bool) -> dict:
    """SuperLink + 3 SuperNodes as processes on loopback."""
    name = "processes" + ("-tls" if tls else "") + ("-auth" if auth else "")
    with LocalDeployment(work / name, 3, tls=tls, auth=auth) as deployment:
        cfg = {**CONFIG, "num-server-rounds": rounds, "output-dir": str(work / name)}
        return _round_times(submit_run(deployment, ROOT, cfg, 3, 900), rounds)


def containers(work: Path, rounds: int, image: str) -> dict:
    """docker/compose.yaml: SuperLink + 3 SuperNodes in containers."""
    from fedadapt.deploy.compose import ComposeProject

    compose = subprocess.run(
        [str(ROOT / "docker" / "engine.sh"), "compose"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    if subprocess.run(["docker", "image", "inspect", image],
                      capture_output=True, check=False).returncode:  # fmt: skip
        raise RuntimeError(f"no image {image} (docs/docker.md)")
    project = ComposeProject(
        compose, "fadbench", [ROOT / "docker" / "compose.yaml"], work / "c", image
    )
    project.prepare()
    try:
        project("up", "-d")
        connection = project.connection()
        project.wait_online(connection, 3)
        cfg = {**CONFIG, "num-server-rounds": rounds, "output-dir": "/results"}
        outcome = submit_run(connection, ROOT, cfg, 3, 900, results_dir=project.results)
        return _round_times(outcome, rounds)
    finally:
        project.down()


def main() -> None:
    """Run every mode once, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--image", default="fedadapt:cpu-test")
    parser.add_argument("--no-containers", action="store_true")
    parser.add_argument(
        "--output", type=Path, default=Path("outputs/bench-deploy.json")
    )
    args = parser.parse_args()
    modes = {
        "simulation": lambda w: simulation(w, args.rounds),
        "processes": lambda w: processes(w, args.rounds, False, False),
        "processes+tls": lambda w: processes(w, args.rounds, True, False),
        "processes+tls+auth": lambda w: processes(w, args.rounds, True, True),
    }
    if not args.no_containers:
        modes["containers"] = lambda w: containers(w, args.rounds, args.image)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="fa-bench-") as tmp:
        for name, run in modes.items():
            started = time.monotonic()
            try:
                results[name] = run(Path(tmp))
            except (RuntimeError, TimeoutError, OSError) as error:
                results[name] = {"skipped": str(error)}
            print(f"{name}: done in {time.monotonic() - started:.0f}s", flush=True)
    base = results["simulation"]["median_round_s"]
    print("\n| mode | median round (s) | vs simulation | round 1 (s) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped'][:60]} | | |")
            continue
        ratio = r["median_round_s"] / base
        print(f"| {name} | {r['median_round_s']:.2f} | {ratio:.2f}x | "
              f"{r['first_round_s']:.2f} |")  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(
        {"config": CONFIG, "rounds": args.rounds, "machine": platform.platform(),
         "results": results}, indent=2))  # fmt: skip
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
