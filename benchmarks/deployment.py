"""Round wall time: Ray simulation vs processes vs containers, and what TLS adds.

Runs the same app and config (digits-mlp, 3 clients, FedAvg, fixed local
steps, central evaluation each round) in each mode, reads every round's wall
time from results.json, and prints the median of the steady rounds (round 1
excluded: in simulation it pays for Ray's start) with the ratio against the
simulation measured in the same invocation. Writes JSON (every round time,
the load of the machine before and after each mode) to --output.

    .venv/bin/python benchmarks/deployment.py [--rounds 4] [--modes simulation …]

Modes: ``simulation`` (``fedadapt simulate``'s private simulation SuperLink),
``processes``, ``processes+tls``, ``processes+tls+auth`` (``fedadapt deploy``'s
SuperLink + 3 SuperNodes on loopback), ``containers`` (docker/compose.yaml:
needs a Docker engine that answers and the image, built as docs/docker.md
shows, tag --image; ``--start-engine`` starts one with docker/engine.sh and
stops only that). A mode that cannot run is reported as skipped, with why.
Timings are only comparable when nothing else heavy runs: the script lists
Flower, Docker, Ray, pytest, pip and make processes it finds before each mode.

Measured (2 cores, nothing else running, 4 rounds, benchmarks/results/
deployment.json): simulation 0.4 s per steady round, processes 24 s, +TLS
27 s, +TLS+auth 20 s, containers 21 s. A deployment round is dominated by
the new ``flwr-clientapp`` process each SuperNode starts per message (Python,
torch and data loaded again every round), which the simulation's long-lived
Ray actors pay once; TLS and authentication differ by less than the
run-to-run spread.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedadapt.tools.submission import RunOutcome, SimulationSuperLink, submit_run  # noqa: E402

CONFIG: dict[str, Any] = {
    "task": "digits-mlp",
    "strategy": "fedavg",
    "clients-per-round": 3,
    "local-steps": 10,
    "evaluate-every": 1,
}
#: The baseline: a minimal Flower PyTorch app (Flower's FedAvg, the same MLP,
#: digits and local steps; benchmarks/minimal_app), run in the same modes.
MINIMAL = ROOT / "benchmarks" / "minimal_app"
MINIMAL_CONFIG: dict[str, Any] = {"local-steps": 10, "batch-size": 32,
                                  "client-lr": 0.1}  # fmt: skip
#: fedadapt as it runs, fedadapt without the node's warm worker (each
#: message's flwr-clientapp process does the work itself: before issue #40's
#: worker; the simulation never uses one) and the minimal app, same run.
APPS = {
    "fedadapt": (ROOT, CONFIG),
    "fedadapt-no-worker": (ROOT, {**CONFIG, "client-worker": "off"}),
    "minimal": (MINIMAL, MINIMAL_CONFIG),
}
#: Each app's ClientApp module: what every flwr-clientapp process imports.
CLIENT_MODULES = {
    "fedadapt": "fedadapt.client.client_app",
    "minimal": "minimal_app.client_app",
}
CLIENTS = 3
#: The deployment's size (``--clients``; the containers mode has 3 services).
SIZE = {"clients": CLIENTS}
TIMEOUT = 1800.0
# processes that skew timings when they run beside the benchmark
HEAVY = "flower|flwr-|dockerd|containerd-shim|raylet|gcs_server|pytest|pip |make "


class Skipped(Exception):
    """A mode that cannot run here (no engine, no image, …)."""


def machine_load() -> dict[str, Any]:
    """Load average and the heavy processes running now besides this script.

    Returns
    -------
    dict
        ``loadavg`` (1, 5, 15 min) and ``others``: command lines of Flower,
        Docker, Ray and pytest processes (cut to 150 characters).
    """
    found = subprocess.run(
        ["pgrep", "-af", HEAVY], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    own = str(os.getpid())
    others = [line[:150] for line in found if line.split(" ", 1)[0] != own]
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "others": others}


def settled_load(wait: float = 30.0) -> dict[str, Any]:
    """``machine_load()`` once no heavy process is left, or after ``wait`` s.

    The previous mode's processes may take a few seconds to exit after it
    stopped them; other users' processes are recorded, not waited for.
    """
    deadline = time.monotonic() + wait
    load = machine_load()
    while load["others"] and time.monotonic() < deadline:
        time.sleep(2)
        load = machine_load()
    return load


def round_times(outcome: RunOutcome, rounds: int) -> dict[str, Any]:
    """Per-round wall times of a finished run, from its results.json.

    Parameters
    ----------
    outcome : RunOutcome
        What ``submit_run`` returned.
    rounds : int
        Rounds the run was asked for.

    Returns
    -------
    dict
        ``round_s`` (every round), ``first_round_s``, ``median_round_s``
        (rounds 2..N) and ``run_s`` (submit to outcome, as the CLI sees it).
    """
    if not outcome.ok or outcome.results is None:
        raise RuntimeError(f"run {outcome.status}: {outcome.details} "
                           f"{outcome.problems}")  # fmt: skip
    data = json.loads(outcome.results.read_text())
    times = [r["wall_time_s"] for r in data["rounds"]]
    if len(times) != rounds:
        raise RuntimeError(f"{len(times)} of {rounds} rounds recorded")
    found = {
        "round_s": [round(t, 3) for t in times],
        "first_round_s": round(times[0], 3),
        "median_round_s": round(statistics.median(times[1:] or times), 3),
        "run_s": round(outcome.wall_time_s, 1),
    }
    clients = outcome.results.with_name("clients.jsonl")
    if clients.exists():  # fedadapt's per-reply records (the minimal app has none)
        found["breakdown"] = breakdown(clients, times)
    return found


def breakdown(clients: Path, times: list[float]) -> dict[str, Any]:
    """Where a steady round goes, from clients.jsonl (issue #40 item 4).

    Per round, over its replies: ``start-up`` = the slowest reply's
    ``process_age_s − train_time_s`` (a new ``flwr-clientapp`` process per
    message: interpreter, imports, data), ``training`` = the slowest
    ``train_time_s`` (data from memory, training, evaluation when folded in),
    and ``waiting`` = the round's wall time minus the oldest reply's process
    age: what no client-side work explains (the SuperNode's 3-s idle poll,
    the SuperExec's task poll, reply pushes, the ServerApp's pull, and the
    server's own aggregation and central evaluation). Medians over rounds
    2..N (s); None when the replies carry no process age (older clients) or
    their processes outlived the round (a simulation's Ray actors).
    ``devices``: every reply's training device (``cpu``, ``cuda:0``, …).
    """
    per_round: dict[int, list[dict[str, Any]]] = {}
    devices: set[str] = set()
    for line in clients.read_text().splitlines():
        record = json.loads(line)
        devices.add(str(record.get("device")))
        if record.get("process_age_s") is not None and record.get("train_time_s"):
            per_round.setdefault(record["round"], []).append(record)
    parts: dict[str, list[float]] = {"start-up": [], "training": [], "waiting": []}
    for number, wall in enumerate(times, start=1):
        replies = per_round.get(number)
        if number == 1 or not replies:
            continue
        ages = [r["process_age_s"] for r in replies]
        if max(ages) > wall:  # long-lived processes (Ray actors): no per-message start
            continue
        parts["start-up"].append(max(a - r["train_time_s"] for a, r in
                                     zip(ages, replies, strict=True)))  # fmt: skip
        parts["training"].append(max(r["train_time_s"] for r in replies))
        parts["waiting"].append(wall - max(ages))
    found: dict[str, Any] = {
        name: round(statistics.median(values), 3) if values else None
        for name, values in parts.items()
    }
    found["devices"] = sorted(devices)  # where the replies trained
    return found


#: The apps the process modes run (``--apps``).
SELECTED_APPS: list[str] = list(APPS)


def run_apps(
    target: Any, work: Path, rounds: int, apps: tuple[str, ...] | None = None, **kw: Any
) -> dict[str, Any]:
    """Run each app of :data:`APPS` on ``target``, one after the other.

    Returns per app the round times (:func:`round_times`) and, when both ran,
    ``fedadapt_vs_minimal`` (and ``fedadapt-no-worker_vs_minimal``): the
    ratio of their median steady rounds. ``apps`` narrows the apps run.
    """
    found: dict[str, Any] = {}
    apps = tuple(SELECTED_APPS) if apps is None else apps
    output_dir = kw.pop("output_dir", None)
    for name, (app, config) in APPS.items():
        if name not in apps:
            continue
        out = output_dir or str(work / name)
        cfg = {**config, "num-server-rounds": rounds, "output-dir": out}
        found[name] = round_times(
            submit_run(target, app, cfg, SIZE["clients"], TIMEOUT, **kw), rounds
        )
    for name in ("fedadapt", "fedadapt-no-worker"):
        if name in found and "minimal" in found:
            found[f"{name}_vs_minimal"] = round(
                found[name]["median_round_s"] / found["minimal"]["median_round_s"], 2
            )
    return found


def simulation(work: Path, rounds: int) -> dict[str, Any]:
    """Flower's Ray simulation on a private simulation SuperLink."""
    with SimulationSuperLink(work / "home") as link:  # no worker in simulation
        return run_apps(link, work, rounds, apps=("fedadapt", "minimal"))


def processes(
    work: Path, rounds: int, tls: bool, auth: bool, parts: str | None = None
) -> dict[str, Any]:
    """SuperLink + 3 SuperNodes as processes on loopback (``fedadapt deploy``).

    ``parts``: None runs ``fedadapt-supernode`` as deployed (short waits and
    the warm SuperExec); ``""`` Flower's ``flower-supernode``; ``"poll"`` or
    ``"fork"`` one of the two changes alone (``FEDADAPT_SUPERNODE_PARTS``).
    """
    try:
        from fedadapt.tools.deploy.local import LocalDeployment
        from fedadapt.tools.deploy.supernode import PARTS_ENV
    except ImportError as error:
        raise Skipped(f"fedadapt.tools.deploy.local unavailable: {error}") from error
    kind = "flower" if parts == "" else "fedadapt"
    saved = os.environ.pop(PARTS_ENV, None)
    if parts:
        os.environ[PARTS_ENV] = parts
    try:
        with LocalDeployment(
            work / "deploy", SIZE["clients"], tls=tls, auth=auth, supernode=kind
        ) as deployment:
            return run_apps(deployment, work, rounds)
    finally:
        os.environ.pop(PARTS_ENV, None)
        if saved is not None:
            os.environ[PARTS_ENV] = saved


def flower_pull(mode: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run ``mode`` with Flower's 1-s first retry of a missing object in every
    process it starts (``FEDADAPT_OBJECT_PULL=flower``; fedadapt.server.object_pull)."""
    from fedadapt.server.object_pull import ENV

    saved = os.environ.get(ENV)
    os.environ[ENV] = "flower"
    try:
        return mode(*args)
    finally:
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved


def client_import_s(repeats: int = 3) -> dict[str, float]:
    """Median seconds a fresh Python process takes to import each ClientApp.

    A deployment starts one ``flwr-clientapp`` process per message, so this
    is paid by every client in every round (the simulation pays it once).
    """
    code = ("import time; t = time.perf_counter(); import {}; "
            "print(time.perf_counter() - t)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(MINIMAL)])}
    found = {}
    for app, module in CLIENT_MODULES.items():
        times = [
            float(
                subprocess.run(
                    [sys.executable, "-c", code.format(module)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )  # fmt: skip
            for _ in range(repeats)
        ]
        found[app] = round(statistics.median(times), 2)
    found["torch alone"] = round(statistics.median(
        float(subprocess.run(
            [sys.executable, "-c", code.format("torch")],
            capture_output=True, text=True, check=True,
        ).stdout)  # fmt: skip
        for _ in range(repeats)
    ), 2)  # fmt: skip
    return found


def _engine_answers() -> bool:
    try:
        return (
            subprocess.run(
                ["docker", "info"], capture_output=True, timeout=30, check=False
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def containers(
    work: Path, rounds: int, image: str, start_engine: bool = False
) -> dict[str, Any]:
    """docker/compose.yaml: a SuperLink and 3 SuperNodes, each a container.

    With ``start_engine`` an engine is made available with ``docker/engine.sh
    up`` (this process registered as its user) and released afterwards with
    ``down``, which stops the daemon only if engine.sh started it and no
    other user remains.
    """
    if not start_engine:
        return _containers(work, rounds, image)
    engine = str(ROOT / "docker" / "engine.sh")
    user = {**os.environ, "FEDADAPT_ENGINE_USER": str(os.getpid())}
    up = subprocess.run(
        [engine, "up"], capture_output=True, text=True, env=user, check=False
    )
    if up.returncode != 0:
        raise Skipped(f"docker/engine.sh up failed: {up.stderr.strip()[-300:]}")
    try:
        return _containers(work, rounds, image)
    finally:
        subprocess.run([engine, "down"], env=user, check=False)


def _containers(work: Path, rounds: int, image: str) -> dict[str, Any]:
    if not _engine_answers():
        raise Skipped(
            "no Docker engine answers (docker/engine.sh up, or --start-engine)"
        )
    try:
        from fedadapt.tools.deploy.compose import ComposeProject
    except ImportError as error:
        raise Skipped(f"fedadapt.tools.deploy.compose unavailable: {error}") from error
    inspect = subprocess.run(
        ["docker", "image", "inspect", image], capture_output=True, check=False
    )
    if inspect.returncode != 0:
        raise Skipped(f"no image {image} (build it as docs/docker.md shows)")
    compose = subprocess.run(
        [str(ROOT / "docker" / "engine.sh"), "compose"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    if not compose:
        raise Skipped("no docker compose / docker-compose command")
    project = ComposeProject(
        compose, f"fadbench{os.getpid()}", [ROOT / "docker" / "compose.yaml"],
        work, image,
    )  # fmt: skip
    project.prepare()
    try:
        project("up", "-d")
        connection = project.connection()
        project.wait_online(connection, SIZE["clients"])
        result = run_apps(
            connection, work, rounds, output_dir="/results",
            results_dir=project.results,
        )  # fmt: skip
    except BaseException:
        with contextlib.suppress(Exception):  # keep the first error visible
            project.down()
        raise
    project.down()
    return result


def modes(
    rounds: int, image: str, start_engine: bool = False
) -> dict[str, Callable[[Path], dict[str, Any]]]:
    """Every mode by name: a function of a fresh work folder."""
    return {
        "simulation": lambda w: simulation(w, rounds),
        "processes": lambda w: processes(w, rounds, tls=False, auth=False),
        # the same on Flower's SuperNode, then with each of fedadapt-supernode's
        # two changes alone (issue #40: each speed-up against the old, same run)
        "processes-flower-supernode": lambda w: processes(w, rounds, False, False, ""),
        "processes-poll-only": lambda w: processes(w, rounds, False, False, "poll"),
        "processes-fork-only": lambda w: processes(w, rounds, False, False, "fork"),
        # fedadapt-supernode with Flower's 1-s first retry of a missing object
        "processes-flower-pull": lambda w: flower_pull(
            processes, w, rounds, False, False
        ),
        "processes+tls": lambda w: processes(w, rounds, tls=True, auth=False),
        "processes+tls+auth": lambda w: processes(w, rounds, tls=True, auth=True),
        "containers": lambda w: containers(w, rounds, image, start_engine),
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table: each fedadapt variant's median steady round against the
    minimal app's of the same mode, against the simulation, and its split."""
    sim = results.get("simulation", {})
    lines = [
        "| mode | app | round (s) | minimal app round (s) | vs minimal "
        "| vs simulation | round 1 (s) | start-up / training / waiting (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "fedadapt" not in r:
            why = r.get("skipped") or f"failed: {r.get('failed', '')}"
            lines.append(f"| {name} | {why[:90]} | | | | | | |")
            continue
        base = r.get("minimal")
        for app in ("fedadapt", "fedadapt-no-worker"):
            if app not in r:
                continue
            ours = r[app]
            vs_sim = (
                f"{ours['median_round_s'] / sim['fedadapt']['median_round_s']:.1f}x"
                if "fedadapt" in sim
                else "n/a"
            )
            parts = ours.get("breakdown") or {}
            split = " / ".join(
                "n/a" if parts.get(k) is None else f"{parts[k]:.2f}"
                for k in ("start-up", "training", "waiting")
            )
            lines.append(
                f"| {name} | {app} | {ours['median_round_s']:.2f} "
                f"| {'n/a' if base is None else format(base['median_round_s'], '.2f')} "
                f"| {r.get(f'{app}_vs_minimal', 'n/a')}x "
                f"| {vs_sim} | {ours['first_round_s']:.2f} | {split} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen modes one after the other, print the table, write JSON."""
    every = list(modes(0, "").keys())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--modes", nargs="+", choices=every, default=every)
    parser.add_argument("--image", default="fedadapt:cpu-test")
    parser.add_argument(
        "--start-engine", action="store_true",
        help="containers mode: make an engine available (docker/engine.sh up) "
        "and release it afterwards (stopped only if started for this script)",
    )  # fmt: skip
    parser.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks/results/deployment.json"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="run-config device of both apps' clients, e.g. cuda on a GPU machine",
    )
    parser.add_argument(
        "--apps", nargs="+", choices=list(APPS), default=list(APPS),
        help="apps each deployment mode runs (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--clients", type=int, default=CLIENTS,
        help="SuperNodes of the process modes (issue #40's protocol: 2)",
    )  # fmt: skip
    parser.add_argument(
        "--local-steps", type=int, default=CONFIG["local-steps"],
        help="local steps of both apps' clients (issue #40's protocol: 8)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    SELECTED_APPS[:] = args.apps
    SIZE["clients"] = args.clients
    CONFIG["clients-per-round"] = args.clients
    CONFIG["local-steps"] = MINIMAL_CONFIG["local-steps"] = args.local_steps
    CONFIG["device"] = MINIMAL_CONFIG["device"] = args.device
    # SIGTERM → SystemExit, so that every mode stops what it started
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    runs = modes(args.rounds, args.image, args.start_engine)
    results: dict[str, dict[str, Any]] = {}
    imports = client_import_s()
    print(f"ClientApp import in a fresh process (s, median of 3): {imports}",
          flush=True)  # fmt: skip
    try:
        with tempfile.TemporaryDirectory(prefix="fa-bench-") as tmp:
            for name in args.modes:
                before = settled_load()
                if before["others"]:
                    print(f"{name}: note, also running: {before['others']}",
                          flush=True)  # fmt: skip
                started = time.monotonic()
                try:
                    result = runs[name](Path(tmp) / name.replace("+", "-"))
                except Skipped as why:
                    result = {"skipped": str(why)}
                except Exception as error:  # noqa: BLE001 - report, go on
                    result = {"failed": f"{type(error).__name__}: {error}"}
                result["load_before"] = before
                result["loadavg_after"] = machine_load()["loadavg"]
                results[name] = result
                print(f"{name}: {time.monotonic() - started:.0f}s "
                      f"{ {k: v for k, v in result.items() if 'load' not in k} }",
                      flush=True)  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print()
    print(table(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "config": {**CONFIG, "num-server-rounds": args.rounds,
                   "clients": SIZE["clients"]},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "client_import_s": imports,
        "results": results,
    }, indent=2) + "\n")  # fmt: skip
    print(f"\nwritten: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
