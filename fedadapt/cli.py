"""``fedadapt`` command line.

``fedadapt simulate`` runs the app in Flower's Ray simulation on this machine
with a private, loopback-only SuperLink that it starts and always stops
(also on Ctrl-C and on failure). It waits for the run's real outcome (``flwr
run`` exits 0 even when a run fails), prints where the results went, and
exits non-zero unless every round completed with usable replies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from flwr.common.config import parse_config_args

CONNECTION = "fedadapt-sim"
TERMINAL_PREFIX = "finished:"


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_connection(flwr_home: Path, name: str, address: str) -> None:
    """Add or replace connection ``name`` in ``$FLWR_HOME/config.toml``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    config: dict[str, Any] = tomllib.loads(path.read_text()) if path.exists() else {}
    superlink = config.setdefault("superlink", {})
    superlink.setdefault("default", name)
    superlink[name] = {"address": address, "insecure": True}
    path.write_text(tomli_w.dumps(config))


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: our FLWR_HOME, no telemetry/installs."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # daemons spawn flower-superexec / flwr-simulation through PATH
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
    }


class SimulationSuperLink:
    """A ``flower-superlink --simulation`` on loopback, in its own process group.

    Use as a context manager: the whole process group (SuperLink, SuperExec,
    simulation runtime and its Ray workers) is terminated on exit.
    """

    def __init__(self, flwr_home: Path, port: int | None = None) -> None:
        self.flwr_home = flwr_home
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = flwr_home / f"superlink-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SimulationSuperLink:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        env = flower_env(self.flwr_home)
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "flower-superlink"),
                    "--simulation",
                    "--insecure",
                    "--isolation=subprocess",
                    "--host=127.0.0.1",
                    f"--port={self.port}",
                    "--disable-runtime-dependency-installation",
                ],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_healthy(timeout=60)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.address}/health"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"SuperLink exited with {self.process.returncode}; "
                    f"see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        raise TimeoutError(
            f"SuperLink not healthy after {timeout}s; see {self.log_path}"
        )

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate the SuperLink's process group; kill it if it lingers."""
        if self.process is None:
            return
        pgid = self.process.pid
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; give the rest of the group a moment
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.process = None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _flwr(args: Sequence[str], env: dict[str, str], **kw: Any) -> str:
    flwr = str(Path(sys.executable).parent / "flwr")
    done = subprocess.run(
        [flwr, *args], env=env, capture_output=True, text=True, check=False, **kw
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"flwr {' '.join(args)} failed ({done.returncode}):\n"
            f"{done.stdout}{done.stderr}"
        )
    return done.stdout


def run_status(run_id: int, env: dict[str, str]) -> dict[str, Any]:
    """Return ``flwr ls``'s record of the run (status, status-details, …)."""
    out = _flwr(["ls", CONNECTION, "--run-id", str(run_id), "--format", "json"], env)
    return json.loads(out)["runs"][0]


def find_results(output_dir: Path, run_id: int) -> Path | None:
    """Return the results.json written for ``run_id`` under ``output_dir``."""
    for path in sorted(output_dir.glob("*/results.json")):
        try:
            if json.loads(path.read_text()).get("run_id") == run_id:
                return path
        except (OSError, json.JSONDecodeError):
            continue
    return None


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
    superlink: SimulationSuperLink,
    app: Path,
    overrides: dict[str, Any],
    num_supernodes: int,
    timeout: float,
    stream: bool = False,
) -> RunOutcome:
    """Run the app once on ``superlink`` and wait for its real outcome.

    ``overrides`` must hold an absolute ``output-dir``; they are validated
    before anything is submitted (ConfigError names the key).
    """
    from fedadapt.config import validate_run_config

    cfg = validate_run_config(overrides)
    env = flower_env(superlink.flwr_home)
    write_connection(superlink.flwr_home, CONNECTION, superlink.address)
    run_config = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
    started = time.monotonic()
    out = _flwr(
        ["run", str(app), CONNECTION, "--format", "json", "--run-config", run_config,
         "--federation-config", f"num-supernodes={num_supernodes}"],
        env,
    )  # fmt: skip
    run_id = int(json.loads(out)["run-id"])
    streamer = None
    if stream:
        print(f"fedadapt: run {run_id} started on {superlink.address}", flush=True)
        flwr = str(Path(sys.executable).parent / "flwr")
        streamer = subprocess.Popen(
            [flwr, "log", str(run_id), CONNECTION, "--stream"], env=env
        )
    try:
        while True:
            status = run_status(run_id, env)
            if status["status"].startswith(TERMINAL_PREFIX):
                break
            if time.monotonic() - started > timeout:
                _flwr(["stop", str(run_id), CONNECTION], env)
                status = {"status": "timed-out", "status-details": f"> {timeout}s"}
                break
            time.sleep(1.0)
    finally:
        if streamer is not None:
            time.sleep(1.0)  # let the last log lines through
            streamer.terminate()
            streamer.wait(timeout=10)
    path = find_results(Path(cfg["output-dir"]).expanduser().resolve(), run_id)
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


def simulate(args: argparse.Namespace) -> int:
    """Run one simulation end to end; return the process exit code."""
    from fedadapt.config import validate_run_config

    app = Path(args.app).resolve()
    flwr_home = Path(args.flwr_home or app / ".flwr").resolve()
    overrides = parse_config_args([args.run_config] if args.run_config else None)
    overrides.setdefault("output-dir", str(Path("outputs").resolve()))
    validate_run_config(overrides)  # fail fast, before starting anything
    with SimulationSuperLink(flwr_home, args.port) as superlink:
        outcome = submit_run(
            superlink, app, overrides, args.num_supernodes, args.timeout,
            stream=not args.quiet,
        )  # fmt: skip
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedadapt`` command."""
    parser = argparse.ArgumentParser(prog="fedadapt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="run the app in a local simulation")
    sim.add_argument("--app", default=".", help="Flower app directory (default: .)")
    sim.add_argument("--num-supernodes", type=int, default=10)
    sim.add_argument(
        "--run-config", default="", help='overrides, e.g. "num-server-rounds=5 seed=1"'
    )
    sim.add_argument("--flwr-home", help="FLWR_HOME to use (default: <app>/.flwr)")
    sim.add_argument("--port", type=int, help="SuperLink port (default: a free one)")
    sim.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    sim.add_argument("--quiet", action="store_true", help="do not stream run logs")
    args = parser.parse_args(argv)
    try:
        return simulate(args)
    except KeyboardInterrupt:
        print("fedadapt: interrupted; SuperLink stopped", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, TimeoutError) as error:
        print(f"fedadapt: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
