"""Run submission: a private simulation SuperLink, ``submit_run``, ``RunOutcome``.

``flwr run`` exits 0 even when a run fails, so :func:`submit_run` submits a
run to a SuperLink (a :class:`SimulationSuperLink` started here, a local
deployment or someone else's, a :class:`SuperLinkConnection`), follows its
results.json and Flower's status, and returns how it really ended. Used by
``fedadapt simulate|deploy``, ``fedadapt-exp`` and the deployment benchmark.

A run that did not complete has its Flower log fetched while the SuperLink
still runs (``flwr log <run-id> <connection> --show``): saved next to the run
(``<run>/flower.log``), its real error (:func:`~fedadapt.tools.flower_log.real_error`)
reported in :class:`RunOutcome` and, for a failed run, in results.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedadapt._atomic import atomic_write_text
from fedadapt.server.run_folder import (
    FLOWER_LOG_FILE,
    RESULTS_FILE,
    owner_alive,
    record_failure,
    settle,
)
from fedadapt.tools.deploy.process import (
    Daemon,
    ProcessTree,
    SuperLinkConnection,
    flower_env,
    flwr,
    free_port,
    http_ok,
    program,
    raise_if_left,
    signals_deferred,
    write_connection,
)
from fedadapt.tools.flower_log import real_error

__all__ = [
    "RunOutcome",
    "SimulationSuperLink",
    "Submitted",
    "SuperLinkConnection",
    "SuperLinkTarget",
    "fetch_failure_log",
    "free_port",
    "lean_app",
    "run_log",
    "settle_run",
    "submit_run",
]

CONNECTION = "fedadapt-sim"
TERMINAL_PREFIX = "finished:"
#: While a run goes on, its results.json is looked at every RESULTS_POLL_S.
#: Flower is asked (``flwr ls``: a Python process of about 1.6 CPU-seconds,
#: taken from the run it watches on a small machine) FIRST_STATUS_POLL_S
#: after submitting, then at intervals of a quarter of the time elapsed,
#: between FIRST_STATUS_POLL_S and STATUS_POLL_S, so a run that fails before
#: its ServerApp writes anything is still seen within seconds; but not while
#: the ServerApp is writing results.json (status ``running``, changed less
#: than RESULTS_QUIET_S ago: #39, a 500-round cell asked about a hundred
#: times, some 150 CPU-seconds, and its start-up six times). Once
#: results.json says the run ended, Flower is asked every second until it
#: reports the run finished. An unchanged results.json (2 MB by round 500)
#: is read again only every ORPHAN_CHECK_S, which is how soon a ServerApp
#: that died without a word is seen.
RESULTS_POLL_S = 0.5
#: Once results.json holds the last round (the final evaluation and plots
#: follow, ~1 s), it is looked at every END_POLL_S: a suite starts its next
#: cell when it says the run ended (#39); also while the ServerApp's process
#: exits (see OWNER_EXIT_WAIT_S).
END_POLL_S = 0.1
FIRST_STATUS_POLL_S = 5.0
STATUS_POLL_S = 10.0
RESULTS_QUIET_S = 30.0
ORPHAN_CHECK_S = 5.0
#: Once results.json says the run ended, Flower reports it finished only
#: after the ServerApp's process has exited (a simulation's shuts down for
#: 2–4 s more): while that process (on this machine) runs, Flower is not
#: asked, for up to OWNER_EXIT_WAIT_S; then it is asked at once. A process
#: that outlives its run (a ServerApp serving several) costs no more than
#: that: Flower is then asked every second, as before.
OWNER_EXIT_WAIT_S = 10.0
#: Seconds Flower may go on calling a run "running" after its results.json
#: says it ended badly (a ServerApp killed with -9 is never reported by
#: Flower): then the run is stopped and reported failed.
ENDED_GRACE_S = 10.0
#: Seconds ``flwr log --show`` may take to return a run's log.
LOG_TIMEOUT_S = 60.0
#: Seconds the ServerApp of a run Flower reports failed gets to let go of its
#: folder before its results.json is left to :func:`settle_run` (its caller
#: settles it once every process it started has ended).
FAILED_SETTLE_WAIT_S = 5.0


class SimulationSuperLink:
    """A ``flower-superlink --simulation`` on loopback, in its own process group.

    Use as a context manager: on exit every process it started (SuperLink,
    SuperExec, ServerApps and their Ray processes, wherever they moved) is
    terminated, then killed; :class:`ProcessesLeftError` if any survives.
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
        self.tree = ProcessTree()
        self.daemon = Daemon(
            "SuperLink",
            [
                program("flower-superlink"),
                "--simulation",
                "--insecure",
                "--isolation=subprocess",
                "--host=127.0.0.1",
                f"--port={self.port}",
                "--disable-runtime-dependency-installation",
            ],
            # ray.init() in the simulation runtime joins the cluster named by
            # RAY_ADDRESS instead of starting a private one
            self.tree.env(
                flower_env(
                    flwr_home, **({"RAY_ADDRESS": ray_address} if ray_address else {})
                )
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
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the SuperLink and every process of its tree; verify none is left."""
        with signals_deferred():
            left = self.tree.stop()  # the SuperLink and all it started, at once
            self.daemon.stop()  # reap it (kills its group if the tree missed it)
        raise_if_left(left)


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
    """Return ``flwr ls``'s record of the run (status, status-details, …).

    A SuperLink that does not answer (after ``flwr``'s retries) or knows no
    such run means the run is lost: reported ``finished:failed`` with why.
    """
    out = ""
    try:
        out = flwr(["ls", connection, "--run-id", str(run_id), "--format", "json"], env)
        answer = json.loads(out)
        return dict(answer["runs"][0])
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as error:
        text = str(error).strip() if isinstance(error, RuntimeError) else ""
        if not text:
            text = f"its answer was {out.strip()[:300]!r}"
        return {
            "status": "finished:failed",
            "status-details": f"the SuperLink ({connection}) did not report run "
            f"{run_id}; it may have stopped: {text}",
        }


def _stop_run(run_id: int, connection: str, env: dict[str, str]) -> None:
    """``flwr stop`` the run; a SuperLink that is gone has nothing to stop."""
    try:
        flwr(["stop", str(run_id), connection], env)
    except RuntimeError as error:
        print(f"fedadapt: flwr stop {run_id}: {error}", file=sys.stderr)


def run_log(
    run_id: int, env: dict[str, str], connection: str = CONNECTION
) -> str | None:
    """Return Flower's log of the run (ServerApp, ClientApps); None if unavailable.

    Only while the SuperLink that ran it is up: it keeps the logs in memory.
    """
    try:
        return flwr(
            ["log", str(run_id), connection, "--show"],
            env,
            retries=1,
            timeout=LOG_TIMEOUT_S,
        )
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        print(f"fedadapt: flwr log {run_id}: {error}", file=sys.stderr)
        return None


def _log_path(
    run_id: int, results: Path | None, results_root: Path, run_name: str
) -> Path:
    """Where Flower's log of a run goes: ``flower.log`` in its run folder.

    The folder of its results.json, else ``<output-dir>/<run-name>`` unless
    another run's results are there (a folder in use); else
    ``<output-dir>/flower-<run-id>.log``.
    """
    if results is not None:
        return results.parent / FLOWER_LOG_FILE
    folder = results_root / run_name
    if run_name and not (folder / RESULTS_FILE).exists():
        return folder / FLOWER_LOG_FILE
    return results_root / f"flower-{run_id}.log"


def fetch_failure_log(
    run_id: int,
    env: dict[str, str],
    connection: str,
    results: Path | None,
    results_root: Path,
    run_name: str = "",
) -> tuple[str, Path | None]:
    """Fetch and save Flower's log of a run that did not complete.

    Returns (the real error, one line, "" if none found; the saved log, None
    if Flower gave none or it could not be written).
    """
    text = run_log(run_id, env, connection)
    if text is None:
        return "", None
    path = _log_path(run_id, results, results_root, run_name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError as error:
        print(f"fedadapt: cannot save Flower's log to {path}: {error}", file=sys.stderr)
        return real_error(text), None
    return real_error(text), path


def _written(path: Path | None) -> tuple[int, int, int] | None:
    """(inode, mtime in ns, size) of ``path``: changes with every atomic write.

    Compared between looks only, never with this machine's clock (the
    folder may be another machine's).
    """
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


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


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived: unwind (stopping everything), then exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.reason = f"{signal.Signals(signum).name} received"


#: Set by the first stop signal: the command is unwinding, stopping what it
#: started; later signals must not interrupt that (see :func:`raise_on_termination`).
_STOPPING = threading.Event()


def _raise_terminated(signum: int, frame: object) -> None:
    if _STOPPING.is_set():
        _say_already_stopping(signum)
        return
    _STOPPING.set()
    raise Terminated(signum)


def _raise_interrupted(signum: int, frame: object) -> None:
    if _STOPPING.is_set():
        _say_already_stopping(signum)
        return
    _STOPPING.set()
    raise KeyboardInterrupt


_SAID_ALREADY_STOPPING = threading.Event()


def _say_already_stopping(signum: int) -> None:
    if _SAID_ALREADY_STOPPING.is_set():  # once: a barrage must not flood stderr
        return
    _SAID_ALREADY_STOPPING.set()
    try:
        print(
            f"fedadapt: {signal.Signals(signum).name} again: already stopping "
            "every process started (kill -9 leaves them running)",
            file=sys.stderr,
            flush=True,
        )
    except (OSError, ValueError):  # a closed stderr must not break the unwinding
        pass


def raise_on_termination() -> None:
    """Turn SIGTERM/SIGHUP into :class:`Terminated` in the main thread.

    A command that starts processes calls this first, so that a ``kill`` or
    a closed terminal unwinds its ``with`` blocks (which stop and verify
    what they started) like Ctrl-C does, instead of ending the command and
    leaving its SuperLink, ServerApps and Ray behind.

    Only the first stop signal (SIGTERM, SIGHUP or SIGINT) raises: a second
    one (an impatient Ctrl-C, ``timeout`` forwarding the TERM that ``pkill``
    also sent, a supervisor's repeated TERM) would otherwise raise again in
    the middle of the unwinding, between two ``__exit__`` calls of an
    ``ExitStack`` say, and skip the stops still due: a SuperLink left
    running was seen so. Later signals are reported and ignored.
    """
    _STOPPING.clear()
    _SAID_ALREADY_STOPPING.clear()
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupted)


class Cancelled(Exception):
    """:func:`submit_run` stopped waiting because its caller is stopping."""


@dataclass
class Submitted:
    """Where a submitted run writes, filled in by :func:`submit_run` as it goes.

    A caller interrupted meanwhile can still settle the run (:func:`settle_run`).
    """

    run_id: int | None = None
    results_root: Path | None = None
    results: Path | None = None


def settle_run(
    submitted: Submitted, status: str, reason: str, wait: float = 5.0
) -> str | None:
    """Mark a run its ServerApp left ``running`` as ``status`` with ``reason``.

    For a caller that stopped the run (timeout, Ctrl-C, its own error) after
    every process it started has ended; a ServerApp that still holds the run
    folder (still alive, elsewhere) is waited for ``wait`` s and otherwise
    left alone. Returns the status results.json ends with (None: none found).
    """
    path = submitted.results
    if path is None and submitted.run_id is not None and submitted.results_root:
        path = find_results(submitted.results_root, submitted.run_id)
    if path is None:
        return None
    data = settle(path.parent, status, reason, wait)
    return None if data is None else data.get("status")


@dataclass
class RunOutcome:
    """How one ``flwr run`` ended, judged by Flower's status and results.json."""

    run_id: int
    status: str
    details: str
    wall_time_s: float
    results: Path | None
    problems: list[str]
    #: the real error from Flower's log (a run that did not complete)
    error: str = ""
    #: where Flower's log of a run that did not complete was saved
    log: Path | None = None

    @property
    def ok(self) -> bool:
        """Whether the run completed every round with usable replies."""
        return self.status == "finished:completed" and not self.problems


#: Characters that make a path pattern's first component match more than one name.
_WILDCARDS = frozenset("*?[!\\")


def lean_app(app: Path, into: Path) -> Path:
    """Copy into ``into`` only what ``app``'s FAB can hold; return the folder to run.

    ``flwr run APP`` (Flower 1.41/1.42) builds the FAB by walking every file
    under ``APP`` and matching each against the app's patterns, so a
    checkout's ``.venv``, ``build`` and ``outputs`` (tens of thousands of
    files, growing with every suite run) cost each submission about 10 s on
    2 cores (the minimal Flower app's folder: 1 s): issue #39's start-up
    breakdown. With ``fab-include`` patterns whose first component is a
    plain name (fedadapt's: ``fedadapt/**/*.py``, ``LICENSE``) nothing else
    can be in the FAB, so those entries, ``pyproject.toml`` and
    ``.gitignore`` are copied (symlinks as links, which Flower skips, as it
    does in ``APP``) and Flower builds the same FAB from the copy, byte for
    byte (tests/tools/test_lean_app.py). Without such patterns (none, or one
    that starts with a wildcard) ``app`` itself is returned, untouched.
    """
    import shutil
    import tomllib

    try:
        config = tomllib.loads((app / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return app
    patterns = config.get("tool", {}).get("flwr", {}).get("app", {}).get("fab-include")
    if not isinstance(patterns, list) or not patterns:
        return app
    roots = set()
    for pattern in patterns:
        first = str(pattern).lstrip("/").split("/", 1)[0]
        if not first or first in (".", "..") or _WILDCARDS & set(first):
            return app
        roots.add(first)
    into.mkdir(parents=True, exist_ok=True)
    for name in sorted(roots | {"pyproject.toml", ".gitignore"}):
        source = app / name
        if source.is_symlink() or not source.exists():
            continue
        if source.is_dir():
            shutil.copytree(source, into / name, symlinks=True)
        else:
            shutil.copy2(source, into / name)
    return into


def remove_orphaned_apps(flwr_home: Path) -> list[Path]:
    """Delete the lean app copies of submitting processes that no longer exist.

    :func:`submit_run` builds its FAB from a temporary copy
    ``FLWR_HOME/app-<pid>-*`` (:func:`lean_app`) that it removes itself,
    unless it is killed with SIGKILL (or the machine stops) first; the next
    submission removes such leftovers, those whose ``<pid>`` is not a
    running process. Returns the folders removed.
    """
    import shutil

    removed = []
    for folder in Path(flwr_home).glob("app-*-*"):
        pid = folder.name.split("-")[1]
        if not (pid.isdigit() and folder.is_dir()) or _process_exists(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _process_exists(pid: int) -> bool:
    if pid <= 0:  # 0 would signal our own process group
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def submit_run(
    superlink: SuperLinkTarget,
    app: Path,
    overrides: dict[str, Any],
    num_supernodes: int,
    timeout: float,
    stream: bool = False,
    results_dir: Path | None = None,
    federation_config: str = "",
    track: Submitted | None = None,
    cancel: threading.Event | None = None,
    on_ended: Callable[[], None] | None = None,
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
    ``track`` is filled in with the run id and results.json as soon as
    they are known (see :func:`settle_run`). ``cancel``, when set by another
    thread, ends the wait with :class:`Cancelled` (the caller stops the
    SuperLink and settles the run).
    ``on_ended`` is called once, as soon as results.json says the run ended
    (``completed``, ``failed`` or ``stopped``), while Flower's own process
    may still be shutting down (2–4 s on a 2-core machine: its threads
    notice the stop within a second, then it leaves the Ray cluster); a
    suite starts its next cell then (#39). The wait goes on until Flower
    reports the run finished, and the outcome is Flower's.

    While it waits, a results.json left ``running`` by a ServerApp that died
    (kill -9, lost machine) is marked ``failed`` (:func:`settle`), and such a
    run is stopped and reported failed if Flower keeps calling it running.

    A run that does not complete has Flower's log fetched and saved
    (:func:`fetch_failure_log`, ``RunOutcome.log``) and its real error
    reported (``RunOutcome.error``); a failed run's results.json gets that
    error, ``failed`` and ``flower_log`` (:func:`record_failure`; one still
    held by a live ServerApp is left to :func:`settle_run`).
    """
    from fedadapt.config import validate_run_config

    cfg = validate_run_config(overrides)
    env = flower_env(superlink.flwr_home)
    conn = superlink.connection
    write_connection(
        superlink.flwr_home, conn, superlink.address, superlink.root_certificates
    )
    run_config = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
    started, submitted_at = time.monotonic(), time.time()
    remove_orphaned_apps(superlink.flwr_home)
    prefix = f"app-{os.getpid()}-"  # whose copy it is: see remove_orphaned_apps
    with tempfile.TemporaryDirectory(prefix=prefix, dir=superlink.flwr_home) as lean:
        built_from = lean_app(Path(app), Path(lean) / "app")
        command = ["run", str(built_from), conn, "--format", "json"]
        command += ["--run-config", run_config]
        if superlink.simulation:
            federation = f"num-supernodes={num_supernodes} {federation_config}"
            command += ["--federation-config", federation.strip()]
        submitted = json.loads(flwr(command, env))
    if "run-id" not in submitted:  # Flower's {"success": false, "error-message"}
        reason = submitted.get("error-message") or json.dumps(submitted)
        raise RuntimeError(f"Flower refused the run:\n{reason.strip()}")
    run_id = int(submitted["run-id"])
    results_root = results_dir or Path(cfg["output-dir"]).resolve()
    track = track if track is not None else Submitted()
    track.run_id, track.results_root = run_id, results_root
    streamer = None
    if stream:
        print(f"fedadapt: run {run_id} started on {superlink.address}", flush=True)
        streamer = subprocess.Popen(
            [program("flwr"), "log", str(run_id), conn, "--stream"], env=env
        )
    path, ask_flower_at, ended_at = None, started + FIRST_STATUS_POLL_S, None
    exiting = False  # the ServerApp's process, seen after results.json ended
    data, seen, read_at, changed_at = None, None, 0.0, 0.0
    try:
        while True:
            path = path or find_results(results_root, run_id, submitted_at - 5.0)
            track.results = path
            now = time.monotonic()
            written = _written(path)
            if written != seen:  # on our clock: a remote folder's may be skewed
                changed_at = now
            if path is not None and (
                written != seen or now - read_at >= ORPHAN_CHECK_S
            ):
                # settle: a results.json whose ServerApp died is marked failed
                data, seen, read_at = settle(path.parent), written, now
            recorded = (data or {}).get("status")
            ended = recorded in ("completed", "failed", "stopped")
            if ended and ended_at is None:  # Flower will say so shortly
                ended_at, ask_flower_at = now, min(ask_flower_at, now + 1.0)
                if on_ended is not None:
                    on_ended()
            if ended and ended_at is not None and now - ended_at < OWNER_EXIT_WAIT_S:
                owner = (data or {}).get("owner")
                if owner and owner_alive(owner):  # Flower would say "running"
                    ask_flower_at, exiting = max(ask_flower_at, now + 0.1), True
                elif exiting:  # it has just exited: Flower knows by now
                    ask_flower_at, exiting = now, False
            progressing = (
                recorded == "running"
                and written is not None
                and now - changed_at < RESULTS_QUIET_S
            )
            if now >= ask_flower_at and not progressing:
                status = run_status(run_id, env, conn)
                if status["status"].startswith(TERMINAL_PREFIX):
                    break
                wait = max(FIRST_STATUS_POLL_S, (now - started) / 4)
                wait = min(STATUS_POLL_S, wait)
                ask_flower_at = now + (1.0 if ended else wait)
            if ended_at and recorded != "completed" and now - ended_at > ENDED_GRACE_S:
                _stop_run(run_id, conn, env)  # Flower missed the ServerApp's end
                error = (data or {}).get("error", "")
                status = {"status": "finished:failed", "status-details": error}
                break
            if now - started > timeout:
                _stop_run(run_id, conn, env)
                status = {"status": "timed-out", "status-details": f"> {timeout}s"}
                break
            rounds = (data or {}).get("rounds")
            rounds_in = len(rounds) if isinstance(rounds, list) else 0
            ending = recorded == "running" and rounds_in >= cfg["num-server-rounds"]
            pause = (
                min(RESULTS_POLL_S, END_POLL_S) if exiting or ending else RESULTS_POLL_S
            )
            if cancel is None:
                time.sleep(pause)
            elif cancel.wait(pause):
                raise Cancelled(f"run {run_id}: its caller is stopping")
    finally:
        if streamer is not None:
            time.sleep(1.0)  # let the last log lines through
            streamer.terminate()
            streamer.wait(timeout=10)
    path = path or find_results(results_root, run_id)
    error, log = "", None
    if status["status"] != "finished:completed":
        error, log = fetch_failure_log(
            run_id, env, conn, path, results_root, cfg["run-name"]
        )
    if status["status"] == "finished:failed" and path is not None and error:
        fields = {"flower_log": log.name} if log and log.parent == path.parent else {}
        record_failure(path.parent, run_id, error, FAILED_SETTLE_WAIT_S, **fields)
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
        error,
        log,
    )
