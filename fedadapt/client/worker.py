"""A node's warm worker: PyTorch and the node's data loaded once, not per message.

In a deployment Flower starts a new ``flwr-clientapp`` process for every
message a SuperNode receives, and that process exits after one reply
(Flower 1.41/1.42, subprocess isolation; flower-notes §9). Importing torch,
initialising CUDA and loading the node's data in every one of them was most
of a deployment round (issue #40: 13 s of an 18-s round on an H200). So a
``flwr-clientapp`` process of fedadapt imports only Flower and hands the
message's content and the node's context to the node's *worker*, a process
that the first message starts and later messages reuse; it trains exactly
as the ClientApp would in its own process (:mod:`fedadapt.client.handlers`,
the same functions), and sends back the reply's content and the node's
updated ``context.state``.

Lifetime. A worker belongs to one SuperNode: it watches the process that
started the ``flwr-clientapp`` (Flower's SuperExec, which ends with its
SuperNode) and exits within a second of its end; it also exits after
:data:`IDLE_S` seconds without a message (``FEDADAPT_WORKER_IDLE_S``), on
SIGTERM / SIGINT, and with the SuperNode's process group on Ctrl-C (it
stays in that group). ``fedadapt deploy`` stops it with the rest of its
process tree (it inherits the tree's token).

Where. A Unix socket in a per-user directory (mode 0700) under the system's
temp directory, named by a hash of the node id, the owner process (pid and
start time), the interpreter and fedadapt's source: a new SuperNode, a new
fedadapt or another Python gets its own worker. Connections are
authenticated with a random key stored beside the socket (mode 0600).
The worker's output goes to a log file beside it (its tail is in the error
when it fails to start or dies in a message); a worker that ends cleanly
removes its socket, key and log.

Errors. An exception in the worker's handler is raised again in the
``flwr-clientapp`` process (the same type where it can be pickled), so
Flower reports it as it would the in-process one. A worker that dies in a
message makes that message fail with its log's tail; the next message
starts a new one.

Only the standard library and Flower are imported here; torch is imported
by the worker process alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from fedadapt.client.process_info import alive, process_age_s, process_start_ticks
from fedadapt.strategies.wire import PROCESS_AGE_S

__all__ = [
    "alive",
    "as_own_process",
    "call",
    "in_clientapp_process",
    "main",
    "process_age_s",
    "serve",
    "uses_worker",
]

#: Seconds a worker waits for its next message before it exits.
IDLE_S = 600.0
#: Seconds a ``flwr-clientapp`` process waits for a new worker to listen
#: (it imports torch and fedadapt first: seconds, minutes on a busy machine).
START_TIMEOUT_S = 600.0
#: How often the worker checks its owner and its idle time (s).
WATCH_INTERVAL_S = 0.5
#: The longest folder for the sockets (a socket's path must fit ~107 bytes;
#: a longer temp dir falls back to /tmp).
MAX_HOME_CHARS = 70
#: The program names of Flower's per-message ClientApp process.
CLIENTAPP_PROGRAMS = ("flwr-clientapp",)


def in_clientapp_process() -> bool:
    """Return whether this process is Flower's one-message ``flwr-clientapp``.

    Only there does a worker pay off: a simulation's Ray actors and an
    in-process test are warm already.
    """
    return Path(sys.argv[0]).name in CLIENTAPP_PROGRAMS if sys.argv else False


#: run-config key: where a deployment's messages are handled
WORKER_KEY = "client-worker"


def uses_worker(run_config: Mapping[str, Any]) -> bool:
    """Return whether this process hands its messages to the node's worker.

    ``client-worker = "auto"`` (the default): in Flower's one-message
    ``flwr-clientapp`` processes (deployment), not in a simulation's Ray
    actors or in-process tests; ``"off"``: never.
    """
    return run_config.get(WORKER_KEY, "auto") != "off" and in_clientapp_process()


def as_own_process(metrics: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Set a reply's ``process-age-s`` to this process's age (in place).

    The worker measured its own (long) life; clients.jsonl wants the
    message's process, whose start-up and hand-over are then
    ``process-age-s − train-time-s`` (benchmarks/deployment.py).
    """
    age = process_age_s()
    if PROCESS_AGE_S in metrics and age is not None:
        metrics[PROCESS_AGE_S] = age
    return metrics


@dataclass(frozen=True)
class WorkerAddress:
    """Where a node's worker listens, its key file and its log."""

    socket: Path
    key: Path
    log: Path

    @classmethod
    def for_node(cls, node_id: int, owner: int) -> WorkerAddress:
        """Return node ``node_id``'s worker address under process ``owner``."""
        import fedadapt

        source = Path(fedadapt.__file__).resolve().parent
        ident = "|".join(
            map(str, (node_id, owner, process_start_ticks(owner), sys.executable,
                      source, getattr(fedadapt, "__version__", "")))
        )  # fmt: skip
        name = hashlib.sha256(ident.encode()).hexdigest()[:20]
        home = Path(tempfile.gettempdir()) / f"fedadapt-workers-{os.getuid()}"
        if len(str(home)) > MAX_HOME_CHARS:  # a Unix socket path has ~107 bytes
            home = Path("/tmp") / home.name
        home.mkdir(mode=0o700, exist_ok=True)
        if home.stat().st_uid != os.getuid() or home.stat().st_mode & 0o077:
            raise PermissionError(f"{home} must be yours and private (mode 0700)")
        return cls(home / f"{name}.sock", home / f"{name}.key", home / f"{name}.log")


class WorkerError(RuntimeError):
    """The node's worker could not start, or ended during a message."""


def _log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


def _connect(address: WorkerAddress) -> Connection | None:
    """Return a connection to a listening worker, or None when none listens.

    A reset or closed connection during the handshake counts as none: a
    worker killed mid-message can leave its socket held for a moment by
    what it started, which accepts the connection and then drops it
    (make test saw ConnectionResetError here once).
    """
    try:
        key = address.key.read_bytes()
        return Client(str(address.socket), "AF_UNIX", authkey=key)
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError,
            BrokenPipeError, EOFError):  # fmt: skip
        return None


#: A worker's files untouched this long, whose worker is gone, are swept (s).
STALE_AGE_S = 60.0


def _listening_pid(log: Path) -> int | None:
    """Return the pid a worker's log says listens (its first lines), or None."""
    try:
        with open(log, errors="replace") as handle:
            head = handle.read(4096)
    except OSError:
        return None
    for line in head.splitlines():
        if line.startswith("worker ") and ": listening on " in line:
            with contextlib.suppress(ValueError):
                return int(line.split()[1].rstrip(":"))
    return None


def sweep_stale(home: Path, min_age_s: float = STALE_AGE_S) -> list[Path]:
    """Remove the files of workers that are gone; return what was removed.

    A worker that ends cleanly removes its socket, key and log; one killed
    with SIGKILL cannot, and its address (keyed by its owner's pid and start
    time) is never used again. A name's files are stale when none of them
    changed for ``min_age_s`` (a worker starting now is young) and its log
    names no live listening process (or none at all: it died before it
    listened). A live worker is never touched, whatever its age.
    """
    removed: list[Path] = []
    now = time.time()
    for stem in sorted({f.with_suffix("") for f in home.glob("*.*")}):
        files = [stem.with_suffix(s) for s in (".sock", ".key", ".log")]
        present = [f for f in files if f.exists() or f.is_socket()]
        try:
            youngest = max(f.lstat().st_mtime for f in present)
        except (OSError, ValueError):
            continue
        if now - youngest < min_age_s:
            continue
        pid = _listening_pid(stem.with_suffix(".log"))
        if pid is not None and alive(pid, None):
            continue
        for f in present:
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f)
    return removed


def _start(address: WorkerAddress, owner: int) -> subprocess.Popen[bytes]:
    """Start a worker for ``address``; it listens once it has imported torch.

    The files of workers that are gone (killed: a clean end removes its
    own) are swept first (:func:`sweep_stale`).
    """
    with contextlib.suppress(OSError):
        sweep_stale(address.socket.parent)
    with contextlib.suppress(FileNotFoundError):
        address.socket.unlink()  # a dead worker's socket
    key = secrets.token_bytes(32)
    fd = os.open(address.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key)
    env = dict(os.environ)
    # the ClientApp's imports (the installed FAB's folder among them)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    with open(address.log, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fedadapt.client.worker", str(address.socket),
             str(address.key), str(owner)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
            close_fds=True,
        )  # fmt: skip


def _connect_or_start(address: WorkerAddress, owner: int) -> Connection:
    conn = _connect(address)
    if conn is not None:
        return conn
    process = _start(address, owner)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise WorkerError(
                f"the node's worker exited with {process.returncode} before it "
                f"listened ({address.log}):\n{_log_tail(address.log)}"
            )
        conn = _connect(address)
        if conn is not None:
            return conn
        time.sleep(0.05)
    process.kill()
    raise WorkerError(f"the node's worker did not listen within {START_TIMEOUT_S} s")


def call(kind: str, content: Any, context: Any, owner: int | None = None) -> Any:
    """Run message ``kind`` ("train", "evaluate") on the node's worker.

    ``content`` is the message's RecordDict, ``context`` the node's Flower
    Context, whose ``state`` is replaced by the worker's updated state.
    ``owner``: the process whose end ends the worker (default: this
    process's parent, Flower's SuperExec). Returns the reply's content.
    """
    owner = os.getppid() if owner is None else owner
    address = WorkerAddress.for_node(int(context.node_id), owner)
    request = (
        kind, content, int(context.run_id), int(context.node_id),
        dict(context.node_config), context.state, dict(context.run_config),
    )  # fmt: skip
    lost = (EOFError, ConnectionResetError, BrokenPipeError)
    for attempt in (1, 2):
        conn = _connect_or_start(address, owner)
        with conn:
            try:
                conn.send(request)
            except lost:
                # a worker that left (idle) just as we connected: it never
                # read the message, so start another (once)
                if attempt == 2:
                    raise
                continue
            try:
                status, *answer = conn.recv()
            except lost as error:  # it died with the message: no second try
                raise WorkerError(
                    f"the node's worker ended during the {kind} message "
                    f"({address.log}):\n{_log_tail(address.log)}"
                ) from error
        break
    if status == "error":
        raise answer[0]
    reply, state = answer
    context.state.clear()
    for key, value in state.items():
        context.state[key] = value
    return reply


# --- the worker process ----------------------------------------------------------


def _handle(request: tuple[Any, ...]) -> tuple[Any, ...]:
    from flwr.app import Context

    from fedadapt.client.handlers import HANDLERS

    kind, content, run_id, node_id, node_config, state, run_config = request
    context = Context(run_id, node_id, node_config, state, run_config)
    try:
        reply = HANDLERS[kind](content, context)
    except Exception as error:  # noqa: BLE001 - raised again in the ClientApp
        try:  # the ClientApp must be able to rebuild it: a full round trip
            pickle.loads(pickle.dumps(error))
            return ("error", error)
        except Exception:  # noqa: BLE001 - an exception that cannot travel
            # its text as it is (a node's one-line error starts "node <id>")
            text = str(error) or "".join(
                traceback.format_exception_only(type(error), error)
            )
            return ("error", RuntimeError(text.strip()))
    return ("ok", reply, context.state)


def serve(socket: Path, key_file: Path, owner: int) -> None:
    """Answer requests on ``socket`` until the owner ends or idleness times out."""
    import fedadapt.client.handlers  # noqa: F401 - torch and fedadapt, once

    idle_s = float(os.environ.get("FEDADAPT_WORKER_IDLE_S", IDLE_S))
    owner_start = process_start_ticks(owner)
    listener = Listener(str(socket), "AF_UNIX", authkey=key_file.read_bytes())
    last = [time.monotonic()]
    busy = threading.Event()

    def leave(code: int = 0) -> None:
        # a clean end leaves nothing behind (a crash leaves its log)
        for path in (socket, key_file, socket.with_suffix(".log")):
            with contextlib.suppress(OSError):
                path.unlink()
        os._exit(code)

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if not alive(owner, owner_start):
                print(f"worker {os.getpid()}: owner {owner} ended", flush=True)
                leave()
            if not busy.is_set() and time.monotonic() - last[0] > idle_s:
                print(f"worker {os.getpid()}: idle {idle_s:g} s", flush=True)
                leave()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: leave(0))
    threading.Thread(target=watch, daemon=True).start()
    print(f"worker {os.getpid()}: listening on {socket} for owner {owner}", flush=True)
    while True:
        try:
            conn = listener.accept()
        except Exception as error:  # noqa: BLE001 - a failed handshake: not ours
            print(f"worker {os.getpid()}: refused a connection: {error}", flush=True)
            continue
        busy.set()
        try:
            with conn:
                request = conn.recv()
                conn.send(_handle(request))
        except (EOFError, OSError) as error:
            print(f"worker {os.getpid()}: connection lost: {error}", flush=True)
        finally:
            last[0] = time.monotonic()
            busy.clear()


def main(argv: list[str] | None = None) -> None:
    """``python -m fedadapt.client.worker SOCKET KEY_FILE OWNER_PID``."""
    socket, key_file, owner = argv if argv is not None else sys.argv[1:]
    serve(Path(socket), Path(key_file), int(owner))


if __name__ == "__main__":
    main()
