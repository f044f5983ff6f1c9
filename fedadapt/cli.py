"""``fedadapt`` command line.

``fedadapt deploy`` does the same on a real deployment started here (a
SuperLink and N SuperNodes as processes, optionally TLS + SuperNode
authentication; ``fedadapt.deploy.local``); ``fedadapt certs`` and
``fedadapt node-keys`` make the certificates and keys for one elsewhere.

``fedadapt simulate`` runs the app in Flower's Ray simulation on this machine
with a private, loopback-only SuperLink that it starts and always stops
(also on Ctrl-C and on failure). It waits for the run's real outcome (``flwr
run`` exits 0 even when a run fails), prints where the results went, and
exits non-zero unless every round completed with usable replies.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flwr.common.config import parse_config_args

from fedadapt.deploy.process import (
    Daemon,
    flower_env,
    flwr,
    free_port,
    http_ok,
    venv_bin,
    write_connection,
)

CONNECTION = "fedadapt-sim"
TERMINAL_PREFIX = "finished:"
#: While a run goes on, its results.json is read every RESULTS_POLL_S and
#: ``flwr ls`` asked at intervals of a quarter of the time elapsed, between
#: FIRST_STATUS_POLL_S and STATUS_POLL_S: each call starts a Python process
#: costing about 1.5 CPU-seconds, which on a 2-core machine slowed the run it
#: watched, while a run that fails at start is still seen within seconds.
#: Once results.json says the run ended, ``flwr ls`` is asked every second
#: until Flower reports it finished.
RESULTS_POLL_S = 0.5
FIRST_STATUS_POLL_S = 2.0
STATUS_POLL_S = 10.0


@dataclass
class SuperLinkConnection:
    """A SuperLink someone else runs (containers, another host): where and how."""

    flwr_home: Path
    address: str
    connection: str = "fedadapt"
    root_certificates: Path | None = None
    simulation: bool = False


class SimulationSuperLink:
    """A ``flower-superlink --simulation`` on loopback, in its own process group.

    Use as a context manager: the whole process group (SuperLink, SuperExec,
    simulation runtime and its Ray workers) is terminated on exit.
    """

    connection = CONNECTION
    root_certificates: Path | None = None
    simulation = True

    def __init__(
        self, flwr_home: Path, port: int | None = None, ray_address: str | None = None
    ) -> None:
        self.flwr_home = flwr_home
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.daemon = Daemon(
            "SuperLink",
            [
                str(venv_bin() / "flower-superlink"),
                "--simulation",
                "--insecure",
                "--isolation=subprocess",
                "--host=127.0.0.1",
                f"--port={self.port}",
                "--disable-runtime-dependency-installation",
            ],
            # ray.init() in the simulation runtime joins the cluster named by
            # RAY_ADDRESS instead of starting a private one
            flower_env(
                flwr_home, **({"RAY_ADDRESS": ray_address} if ray_address else {})
            ),
            flwr_home / f"superlink-{self.port}.log",
        )

    def __enter__(self) -> SimulationSuperLink:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.daemon.start()
        try:
            self.daemon.wait_until(
                lambda: http_ok(f"http://{self.address}/health"), 60, "healthy"
            )
        except BaseException:
            self.daemon.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate the SuperLink's process group; kill it if it lingers."""
        self.daemon.stop()


class SuperLinkTarget(Protocol):
    """What submit_run needs of a running SuperLink (simulation or deployment)."""

    flwr_home: Path
    address: str
    connection: str
    root_certificates: Path | None
    simulation: bool


def run_status(
    run_id: int, env: dict[str, str], connection: str = CONNECTION
) -> dict[str, Any]:
    """Return ``flwr ls``'s record of the run (status, status-details, …)."""
    out = flwr(["ls", connection, "--run-id", str(run_id), "--format", "json"], env)
    return json.loads(out)["runs"][0]


def find_results(
    output_dir: Path, run_id: int, modified_after: float = 0.0
) -> Path | None:
    """Return the results.json written for ``run_id`` under ``output_dir``.

    ``modified_after`` (a ``time.time()``) skips files not written since then.
    """
    for path in sorted(output_dir.glob("*/results.json")):
        try:
            if path.stat().st_mtime < modified_after:
                continue
            if json.loads(path.read_text()).get("run_id") == run_id:
                return path
        except (OSError, json.JSONDecodeError):
            continue
    return None


def recorded_status(path: Path | None) -> str | None:
    """``status`` of a results.json (running/completed/failed); None if unreadable."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text()).get("status")
    except (OSError, json.JSONDecodeError):
        return None  # being replaced right now: read again next time


def problems_in(results: dict[str, Any], num_rounds: int) -> list[str]:
    """Return why a finished run is not a success (empty list: success)."""
    found = []
    if results.get("status") != "completed":
        found.append(f"results status is {results.get('status')!r}")
    rounds = results.get("rounds", [])
    if len(rounds) != num_rounds:
        found.append(f"{len(rounds)} of {num_rounds} rounds recorded")
    empty = [r["round"] for r in rounds if not (r.get("replies") or {}).get("used")]
    if empty:
        found.append(f"rounds without usable train replies: {empty}")
    return found


@dataclass
class RunOutcome:
    """How one ``flwr run`` ended, judged by Flower's status and results.json."""

    run_id: int
    status: str
    details: str
    wall_time_s: float
    results: Path | None
    problems: list[str]

    @property
    def ok(self) -> bool:
        """Whether the run completed every round with usable replies."""
        return self.status == "finished:completed" and not self.problems


def submit_run(
    superlink: SuperLinkTarget,
    app: Path,
    overrides: dict[str, Any],
    num_supernodes: int,
    timeout: float,
    stream: bool = False,
    results_dir: Path | None = None,
    federation_config: str = "",
) -> RunOutcome:
    """Run the app once on ``superlink`` and wait for its real outcome.

    ``overrides`` must hold an absolute ``output-dir``; they are validated
    before anything is submitted (ConfigError names the key). In simulation
    ``num_supernodes`` sizes the federation; in deployment the SuperNodes
    that are connected are the federation. ``results_dir`` is where
    ``output-dir`` appears on this machine when the ServerApp runs elsewhere
    (a container's mounted folder); default: ``output-dir`` itself.
    ``federation_config`` adds simulation settings (``flwr run
    --federation-config``), e.g. ``"client-resources-num-cpus=1"``.
    """
    from fedadapt.config import validate_run_config

    cfg = validate_run_config(overrides)
    env = flower_env(superlink.flwr_home)
    conn = superlink.connection
    write_connection(
        superlink.flwr_home, conn, superlink.address, superlink.root_certificates
    )
    run_config = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
    command = ["run", str(app), conn, "--format", "json", "--run-config", run_config]
    if superlink.simulation:
        federation = f"num-supernodes={num_supernodes} {federation_config}"
        command += ["--federation-config", federation.strip()]
    started, submitted_at = time.monotonic(), time.time()
    submitted = json.loads(flwr(command, env))
    if "run-id" not in submitted:  # Flower's {"success": false, "error-message"}
        reason = submitted.get("error-message") or json.dumps(submitted)
        raise RuntimeError(f"Flower refused the run:\n{reason.strip()}")
    run_id = int(submitted["run-id"])
    results_root = results_dir or Path(cfg["output-dir"]).resolve()
    streamer = None
    if stream:
        print(f"fedadapt: run {run_id} started on {superlink.address}", flush=True)
        streamer = subprocess.Popen(
            [str(venv_bin() / "flwr"), "log", str(run_id), conn, "--stream"], env=env
        )
    path, ask_flower_at = None, 0.0
    try:
        while True:
            path = path or find_results(results_root, run_id, submitted_at - 5.0)
            ended = recorded_status(path) in ("completed", "failed")
            now = time.monotonic()
            if ended:  # the ServerApp is done: Flower will say so shortly
                ask_flower_at = min(ask_flower_at, now + 1.0)
            if now >= ask_flower_at:
                status = run_status(run_id, env, conn)
                if status["status"].startswith(TERMINAL_PREFIX):
                    break
                wait = max(FIRST_STATUS_POLL_S, (now - started) / 4)
                wait = min(STATUS_POLL_S, wait)
                ask_flower_at = now + (1.0 if ended else wait)
            if now - started > timeout:
                flwr(["stop", str(run_id), conn], env)
                status = {"status": "timed-out", "status-details": f"> {timeout}s"}
                break
            time.sleep(RESULTS_POLL_S)
    finally:
        if streamer is not None:
            time.sleep(1.0)  # let the last log lines through
            streamer.terminate()
            streamer.wait(timeout=10)
    path = path or find_results(results_root, run_id)
    problems = []
    if status["status"] == "finished:completed":
        if path is None:
            problems = ["no results.json written"]
        else:
            problems = problems_in(
                json.loads(path.read_text()), cfg["num-server-rounds"]
            )
    return RunOutcome(
        run_id,
        status["status"],
        status.get("status-details", ""),
        time.monotonic() - started,
        path,
        problems,
    )


def _prepare(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """App path and validated run-config overrides (fail before starting)."""
    from fedadapt.config import validate_run_config

    app = Path(args.app).resolve()
    overrides = parse_config_args([args.run_config] if args.run_config else None)
    overrides.setdefault("output-dir", str(Path("outputs").resolve()))
    validate_run_config(overrides)
    return app, overrides


def report(outcome: RunOutcome) -> int:
    """Print how a run ended; return the process exit code (0 = success)."""
    print(f"fedadapt: run {outcome.run_id} {outcome.status} in "
          f"{outcome.wall_time_s:.1f}s", flush=True)  # fmt: skip
    if outcome.status != "finished:completed":
        print(f"fedadapt: {outcome.details}", file=sys.stderr)
        return 1
    if outcome.results is not None:
        print(f"fedadapt: results: {outcome.results}")
        print(f"fedadapt: curves:  {outcome.results.parent / 'curves.png'}")
    for problem in outcome.problems:
        print(f"fedadapt: problem: {problem}", file=sys.stderr)
    return 0 if outcome.ok else 1


def simulate(args: argparse.Namespace) -> int:
    """Run one simulation end to end; return the process exit code."""
    app, overrides = _prepare(args)
    flwr_home = Path(args.flwr_home or app / ".flwr").resolve()
    with SimulationSuperLink(flwr_home, args.port, args.ray_address) as superlink:
        outcome = submit_run(
            superlink, app, overrides, args.num_supernodes, args.timeout,
            stream=not args.quiet, federation_config=args.federation_config,
        )  # fmt: skip
    return report(outcome)


def deploy(args: argparse.Namespace) -> int:
    """Run the app on a SuperLink + SuperNodes started as processes here."""
    from fedadapt.deploy.local import LocalDeployment

    app, overrides = _prepare(args)
    workdir = Path(args.workdir or app / ".flwr-deploy").resolve()
    with LocalDeployment(
        workdir, args.num_supernodes, tls=args.tls, auth=args.auth, port=args.port
    ) as deployment:
        print(f"fedadapt: SuperLink on {deployment.address} "
              f"({'TLS' if args.tls else 'insecure'}"
              f"{', SuperNode auth' if args.auth else ''}), "
              f"{args.num_supernodes} SuperNodes online; logs in {workdir}",
              flush=True)  # fmt: skip
        outcome = submit_run(
            deployment, app, overrides, args.num_supernodes, args.timeout,
            stream=not args.quiet,
        )  # fmt: skip
    return report(outcome)


def certs(args: argparse.Namespace) -> int:
    """Write a CA and a SuperLink certificate for the given hosts."""
    from fedadapt.deploy.certs import make_certificates

    for path in make_certificates(
        Path(args.out), args.host, args.days, args.force
    ).values():
        print(path)
    return 0


def node_keys(args: argparse.Namespace) -> int:
    """Write SuperNode authentication key pairs."""
    from fedadapt.deploy.certs import make_node_keys, public_key_path

    for path in make_node_keys(Path(args.out), args.count, args.force):
        print(f"{path}  (register {public_key_path(path)})")
    return 0


def _run_options(parser: argparse.ArgumentParser, nodes: int) -> None:
    parser.add_argument("--app", default=".", help="Flower app directory (default: .)")
    parser.add_argument("--num-supernodes", type=int, default=nodes)
    parser.add_argument(
        "--run-config", default="", help='overrides, e.g. "num-server-rounds=5 seed=1"'
    )
    parser.add_argument("--port", type=int, help="SuperLink port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    parser.add_argument("--quiet", action="store_true", help="do not stream run logs")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Turn SIGTERM into SystemExit so that context managers stop the daemons."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedadapt`` command."""
    parser = argparse.ArgumentParser(prog="fedadapt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="run the app in a local simulation")
    _run_options(sim, nodes=10)
    sim.add_argument("--flwr-home", help="FLWR_HOME to use (default: <app>/.flwr)")
    sim.add_argument(
        "--ray-address",
        help="run on this existing Ray cluster (e.g. 10.0.0.5:6379) instead of a "
        "private one (docs/ray-cluster.md)",
    )
    sim.add_argument(
        "--federation-config",
        default="",
        help='simulation settings, e.g. "client-resources-num-cpus=1 '
        'client-resources-num-gpus=0.25" (flwr run --federation-config)',
    )
    dep = commands.add_parser(
        "deploy", help="run the app on a SuperLink + SuperNodes started as processes"
    )
    _run_options(dep, nodes=3)
    dep.add_argument("--tls", action="store_true", help="TLS with a generated CA")
    dep.add_argument("--auth", action="store_true", help="SuperNode authentication")
    dep.add_argument(
        "--workdir", help="logs, state, certificates (default: <app>/.flwr-deploy)"
    )
    crt = commands.add_parser("certs", help="make a CA + SuperLink TLS certificate")
    crt.add_argument("--out", required=True, help="output folder")
    crt.add_argument(
        "--host", action="append", required=True,
        help="DNS name or IP the SuperLink is reached at (repeat)",
    )  # fmt: skip
    crt.add_argument("--days", type=int, default=365)
    crt.add_argument("--force", action="store_true", help="replace existing files")
    keys = commands.add_parser("node-keys", help="make SuperNode auth key pairs")
    keys.add_argument("--out", required=True, help="output folder")
    keys.add_argument("--count", type=int, required=True)
    keys.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # stop what we started
    handlers = {"simulate": simulate, "deploy": deploy, "certs": certs,
                "node-keys": node_keys}  # fmt: skip
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("fedadapt: interrupted; every process started was stopped",
              file=sys.stderr)  # fmt: skip
        return 130
    except (ValueError, RuntimeError, TimeoutError, OSError) as error:
        print(f"fedadapt: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
