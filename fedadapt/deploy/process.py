"""Flower daemons as child processes: start, wait until ready, stop for sure.

Each daemon runs in its own process group (``start_new_session``), so that
stopping it also stops what it spawned (SuperExec, ServerApp/ClientApp
processes, Ray workers). Used by ``fedadapt simulate`` (one simulation
SuperLink) and ``fedadapt deploy`` (a SuperLink and N SuperNodes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tomli_w

from fedadapt._atomic import atomic_write_text


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def venv_bin() -> Path:
    """Folder of this interpreter's scripts (flwr, flower-superlink, …)."""
    return Path(sys.executable).parent


def flower_env(flwr_home: Path, **extra: str) -> dict[str, str]:
    """Environment for Flower processes: our FLWR_HOME, no telemetry/installs."""
    return {
        **os.environ,
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # daemons spawn flower-superexec / flwr-simulation through PATH
        "PATH": str(venv_bin()) + os.pathsep + os.environ.get("PATH", ""),
        **extra,
    }


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


def flwr(args: Sequence[str], env: dict[str, str], retries: int = 3, **kw: Any) -> str:
    """Run the ``flwr`` CLI; return its stdout, raise RuntimeError on failure.

    A SuperLink that is briefly unreachable (busy starting its SuperExec on a
    loaded machine, a restarting container) is retried ``retries`` times with
    a growing pause; the CLI reports that before anything reached it.
    """
    for attempt in range(retries + 1):
        done = subprocess.run(
            [str(venv_bin() / "flwr"), *args],
            env=env, capture_output=True, text=True, check=False, **kw,
        )  # fmt: skip
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
        raise TimeoutError(f"{self.name}: not {what} after {timeout}s; "
                           f"see {self.log_path}")  # fmt: skip

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
