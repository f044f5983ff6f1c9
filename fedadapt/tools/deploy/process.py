"""Flower daemons as child processes: start, wait until ready, stop for sure.

Each daemon runs in its own process group (``start_new_session``), so that
stopping it also stops what it spawned (SuperExec, ServerApp/ClientApp
processes, Ray workers). What leaves that group (Ray's GCS, raylet and
workers start their own sessions; parents die and leave them to PID 1) is
still found: every daemon of one :class:`ProcessTree` carries a token in its
environment that all its descendants inherit, and the tree terminates, then
kills, every process that carries it or descends from one, and verifies that
none is left. Used by ``fedadapt simulate`` (one simulation SuperLink) and
``fedadapt deploy`` (a SuperLink and N SuperNodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from fedadapt._atomic import atomic_write_text
from fedadapt.tools.deploy.flwr_cli import run_flwr


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def venv_bin() -> Path:
    """Folder of this interpreter's scripts (flwr, flower-superlink, …)."""
    return Path(sys.executable).parent


def program(name: str) -> str:
    """Return the path of Flower's or Ray's program ``name`` (venv, else PATH).

    A venv has them beside ``sys.executable``; an install with ``pip install
    --target`` or behind a launcher wrapper has them elsewhere on ``PATH``.
    Raises FileNotFoundError naming the program when neither has it.
    """
    beside = venv_bin() / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} not found beside {sys.executable} nor on PATH; install "
            "flwr (and ray for simulations) in this environment or put their "
            "programs on PATH"
        )
    return found


#: Seconds between a SuperExec's polls for a new task (Flower's default is 1;
#: ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``): every message a SuperNode receives
#: waits for this poll before its ClientApp process starts, and every run for
#: the SuperLink's. 0.25 s cuts the mean wait from 0.5 s to 0.125 s per
#: message (issue #40) for four local gRPC calls a second; a value the user
#: set wins.
TASK_POLL_INTERVAL_S = "0.25"


def flower_env(flwr_home: Path, **extra: str) -> dict[str, str]:
    """Environment for Flower processes: our FLWR_HOME, no telemetry/installs.

    Also the SuperExecs' task poll (:data:`TASK_POLL_INTERVAL_S`) unless the
    environment sets one.
    """
    return {
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": TASK_POLL_INTERVAL_S,
        **os.environ,
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # daemons spawn flower-superexec / flwr-simulation through PATH
        "PATH": str(venv_bin()) + os.pathsep + os.environ.get("PATH", ""),
        **extra,
    }


@dataclass
class SuperLinkConnection:
    """A SuperLink someone else runs (containers, another host): where and how."""

    flwr_home: Path
    address: str
    connection: str = "fedadapt"
    root_certificates: Path | None = None
    simulation: bool = False


def write_connection(
    flwr_home: Path, name: str, address: str, root_certificates: Path | None = None
) -> None:
    """Add or replace connection ``name`` in ``$FLWR_HOME/config.toml``.

    Without ``root_certificates`` the connection is ``insecure``; with them
    the CLI verifies the SuperLink's TLS certificate against that CA.
    """
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    config: dict[str, Any] = tomllib.loads(path.read_text()) if path.exists() else {}
    superlink = config.setdefault("superlink", {})
    superlink.setdefault("default", name)
    entry: dict[str, Any] = {"address": address}
    if root_certificates is None:
        entry["insecure"] = True
    else:
        entry["root-certificates"] = str(root_certificates)
    superlink[name] = entry
    # atomically: a concurrent flwr command (cells run in parallel) must never
    # read a half-written file
    atomic_write_text(path, tomli_w.dumps(config))


UNAVAILABLE = "Connection to the SuperLink is unavailable"


def flwr(
    args: Sequence[str],
    env: dict[str, str],
    retries: int = 3,
    timeout: float | None = None,
) -> str:
    """Run the ``flwr`` CLI; return its stdout, raise RuntimeError on failure.

    Each call is a process forked from a helper that imported Flower's CLI
    once (:mod:`fedadapt.tools.deploy.flwr_cli`: ~0.1 s instead of ~0.9 CPU-s
    a call); ``timeout`` seconds at most (:class:`subprocess.TimeoutExpired`).

    A SuperLink that is briefly unreachable (busy starting its SuperExec on a
    loaded machine, a restarting container) is retried ``retries`` times with
    a growing pause; the CLI reports that before anything reached it.
    """
    for attempt in range(retries + 1):
        done = run_flwr(program("flwr"), args, env, timeout)
        if UNAVAILABLE not in done.stdout + done.stderr or attempt == retries:
            break
        time.sleep(2.0 * (attempt + 1))
    if done.returncode != 0:
        raise RuntimeError(
            f"flwr {' '.join(args)} failed ({done.returncode}):\n"
            f"{done.stdout}{done.stderr}"
        )
    return done.stdout


def online_supernodes(env: dict[str, str], connection: str) -> list[str] | None:
    """Node ids the SuperLink lists as online; None while it does not answer."""
    try:
        out = json.loads(
            flwr(["supernode", "list", connection, "--format", "json"], env, retries=0)
        )
    except (RuntimeError, json.JSONDecodeError):
        return None
    if not out.get("success", False):
        return None
    return [n["node-id"] for n in out.get("nodes", []) if n.get("status") == "online"]


#: environment variable that marks every process started for one command
RUN_TOKEN_ENV = "FEDADAPT_RUN_TOKEN"

#: seconds between the two looks that confirm a stopped tree is empty
SETTLE_S = 0.3


class ProcessesLeftError(RuntimeError):
    """Processes started for a command outlived its attempt to stop them."""


def _proc_stat(pid: str | int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # from field 3 (state) on
    return int(fields[1]), fields[0], int(fields[19])


def _started_at(pid: int) -> int | None:
    """Start time of a live (not zombie) process; None once it has ended.

    With the pid it names one process, even after the pid is reused.
    """
    stat = _proc_stat(pid)
    return None if stat is None or stat[1] in ("Z", "X") else stat[2]


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


class ProcessTree:
    """Every process started for one command: marked by a token, found in /proc.

    Daemons get ``tree.env(...)``: the token (:data:`RUN_TOKEN_ENV`) is
    inherited by whatever they start, also by what puts itself in its own
    session or is re-parented to PID 1 (SuperExec, ServerApp, Ray). Children
    of a marked process are included even if they cleared their environment.
    Linux only (reads /proc); zombies count as ended.
    """

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self._marker = f"{RUN_TOKEN_ENV}={self.token}".encode()

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with this tree's token."""
        return {**env, RUN_TOKEN_ENV: self.token}

    def _marked(self, pid: str) -> bool:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False  # ended, or another user's process
        return self._marker in environ.split(b"\0")

    def pids(self) -> dict[int, str]:
        """PID -> command line of every live process of the tree."""
        parents: dict[int, int] = {}
        found: set[int] = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            stat = _proc_stat(entry)
            if stat is None or stat[1] in ("Z", "X"):
                continue
            parents[int(entry)] = stat[0]
            if self._marked(entry):
                found.add(int(entry))
        grown = True
        while grown:  # add descendants of marked processes
            new = {pid for pid, ppid in parents.items() if ppid in found} - found
            grown = bool(new)
            found |= new
        return {pid: _cmdline(pid) for pid in sorted(found)}

    def stop(self, grace: float = 10.0) -> dict[int, str]:
        """Terminate, then kill, every process of the tree; return what is left.

        An empty result is verified: no process carrying the token (or
        descending from one), and none seen in the tree during the stop, was
        alive at two looks :data:`SETTLE_S` apart.

        A process once seen stays stopped-for even when the tree loses it: a
        child that cleared its environment is found only below its parent,
        and when the parent dies first it is re-parented out of the tree
        (Ray's agents outlived a timed-out run that way once, in CI).
        Processes that start while the tree is stopping (a raylet still
        starting its agents) are caught by the second look.
        """
        seen: dict[int, int] = {}  # pid -> start time

        def look() -> dict[int, str]:
            for pid in self.pids():
                started = _started_at(pid)
                if started is not None:
                    seen.setdefault(pid, started)
            return {
                pid: _cmdline(pid)
                for pid, started in seen.items()
                if _started_at(pid) == started
            }

        def settled() -> dict[int, str]:
            if left := look():
                return left
            time.sleep(SETTLE_S)
            return look()

        steps = [(signal.SIGTERM, grace)] + [(signal.SIGKILL, 5.0)] * 3
        left = settled()
        for sig, wait in steps:
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while (left := look()) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = left or settled()
        return left


def raise_if_left(left: dict[int, str]) -> None:
    """Raise :class:`ProcessesLeftError` listing ``left`` (PID -> command)."""
    if left:
        listing = "; ".join(f"{pid}: {cmd[:120]}" for pid, cmd in left.items())
        raise ProcessesLeftError(
            f"{len(left)} processes started here are still running after "
            f"SIGTERM and SIGKILL; stop them by hand: {listing}"
        )


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends (cleanup runs whole).

    A second Ctrl-C must not abort stopping the processes; held signals are
    delivered when the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Daemon:
    """One long-running Flower command in its own process group, with a log."""

    def __init__(
        self, name: str, command: Sequence[str], env: dict[str, str], log_path: Path
    ) -> None:
        self.name = name
        self.command = list(command)
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        """Start the command; its output goes to ``log_path``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int | None:
        """PID of the daemon (also its process group id), None before start."""
        return None if self.process is None else self.process.pid

    def exited(self) -> int | None:
        """Exit code if the daemon has ended, else None."""
        return None if self.process is None else self.process.poll()

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready`` until true; fail early if the daemon exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.exited()
            if code is not None:
                raise RuntimeError(
                    f"{self.name} exited with {code} before {what}; see {self.log_path}"
                )
            if ready():
                return
            time.sleep(0.3)
        raise TimeoutError(
            f"{self.name}: not {what} after {timeout}s; see {self.log_path}"
        )

    def request_stop(self) -> None:
        """Send SIGTERM to the daemon's process group without waiting."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 15.0) -> None:
        """Terminate the daemon's process group; kill what lingers."""
        if self.process is None:
            return
        pgid = self.process.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
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
            while time.monotonic() < deadline and group_alive(pgid):
                time.sleep(0.2)
            if not group_alive(pgid):
                break
        if self.process.poll() is None:
            self.process.wait(timeout=5)
        self.process = None


def group_alive(pgid: int) -> bool:
    """Whether any process of the group ``pgid`` is still alive."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def http_ok(url: str, cafile: Path | None = None) -> bool:
    """Whether GET ``url`` answers 2xx (TLS verified against ``cafile``)."""
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    try:
        with urllib.request.urlopen(url, timeout=2, context=context):
            return True
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
        return False


def stop_all(daemons: Sequence[Daemon]) -> None:
    """Stop several daemons at once (SIGTERM to all, then wait for each)."""
    for daemon in daemons:
        daemon.request_stop()
    for daemon in daemons:
        daemon.stop()
