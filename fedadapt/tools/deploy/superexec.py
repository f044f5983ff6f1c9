"""Flower's SuperExec, starting each ClientApp process already warm (#40).

Flower 1.41/1.42's SuperExec starts a new ``flwr-clientapp`` process for
every message a SuperNode receives (``SubprocessExecutor.launch``:
``subprocess.Popen(["flwr-clientapp", ..., "--token", T])``). That process
spends most of its life importing: ``from flwr.supernode.cli import
flwr_clientapp`` alone takes 3.3 s on a quiet 2-core machine, before it
pulls the message (the training itself runs on the node's warm worker).

``python -m fedadapt.tools.deploy.superexec [flower-superexec flags]`` runs
Flower's own SuperExec with one change: a :class:`ForkServer`, forked
before the SuperExec opens any connection, imports Flower's ClientApp
runtime once, and each ``flwr-clientapp`` launch becomes a ``fork()`` of it
running Flower's own ``flwr_clientapp()`` with the same arguments. The task
process is still one process per message, with Flower's code, token,
parent-process monitor and exit path; it just starts with the imports done.
Everything else the SuperExec launches (other task types) is Flower's
``Popen``, and so is a ClientApp launch if the fork server has gone.

Why fork is safe here: the fork server never opens a gRPC channel nor
starts a thread (it only imports and reads its socket), so each child
starts gRPC from nothing, as a new process would. It ignores SIGCHLD (the
kernel reaps the children; the children get the default back) and exits
when its SuperExec closes the socket or dies. ``fedadapt-supernode`` starts
this SuperExec instead of ``flower-superexec`` (:mod:`fedadapt.tools.deploy.supernode`).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

LOGGER = logging.getLogger(__name__)

#: The task command the fork server runs (Flower's ``TASK_TYPE_TO_COMMAND``).
CLIENTAPP_COMMAND = "flwr-clientapp"
#: What the fork server imports once: Flower's ClientApp process, the
#: Message-API modules every ClientApp imports and httpx's httpcore, which Flower's
#: Runtime API client imports on its first connection (0.1–0.2 s a message
#: in the profiles); not the app itself: Flower loads that from the run's
#: FAB, as in a new process.
PRELOAD = ("flwr.supernode.cli", "flwr.app", "flwr.clientapp", "httpx", "httpcore")


#: A folder: each forked ClientApp process writes its cProfile there
#: (``clientapp-<pid>.prof``), to see where a message's start-up goes.
PROFILE_ENV = "FEDADAPT_CLIENTAPP_PROFILE_DIR"
#: Where Flower 1.41/1.42's SuperExec launches task processes.
EXECUTOR_MODULE = "flwr.supercore.superexec.executor.subprocess_executor"


def flower_program(name: str) -> Callable[[], Any]:
    """Return the function behind Flower's console script ``name``.

    Read from the installed flwr's entry points, so that the program is
    Flower's own in whatever version is installed.
    """
    from importlib.metadata import entry_points

    for entry in entry_points(group="console_scripts", name=name):
        if entry.value.startswith("flwr."):
            function: Callable[[], Any] = entry.load()
            return function
    raise FileNotFoundError(f"{name}: no such Flower program in this environment")


def _run_clientapp_main() -> None:
    flower_program(CLIENTAPP_COMMAND)()


def _exit_code(error: SystemExit) -> int:
    code = error.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _run_task(entry: Callable[[], None], argv: Sequence[str], quiet: bool) -> int:
    """Run ``entry`` as the program ``argv`` in a forked child; its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if quiet:  # as Flower's launch with stdout/stderr=DEVNULL
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    sys.argv = list(argv)
    profile_dir = os.environ.get(PROFILE_ENV)
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        entry()
        code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:  # noqa: BLE001 - a task's crash ends the task only
        traceback.print_exc()
        code = 1
    if profiler is not None and profile_dir:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile_dir, f"clientapp-{os.getpid()}.prof"))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _serve(
    connection: socket.socket, preload: Sequence[str], entry: Callable[[], None]
) -> None:
    """Serve forks: one ``{"argv", "quiet"}`` line in, one ``{"pid"}`` out."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the tasks
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the task imports it again and reports
            traceback.print_exc()
    from fedadapt.server.object_pull import shorten_object_pull_retry

    # each fork asks for its message's objects at once, often before the
    # SuperNode has them: retry after 0.05 s, not 1 s (fedadapt.server.object_pull)
    shorten_object_pull_retry()
    stream = connection.makefile("rwb")
    for line in stream:  # EOF: the SuperExec closed the socket or died
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            stream.close()
            connection.close()
            os._exit(_run_task(entry, request["argv"], bool(request["quiet"])))
        stream.write(json.dumps({"pid": pid}).encode() + b"\n")
        stream.flush()


class ForkServer:
    """A process that has imported ``preload`` and forks a child per task.

    :meth:`start` forks it (call before opening connections or starting
    threads); :meth:`launch` starts one task and returns its pid.
    """

    def __init__(
        self,
        preload: Sequence[str] = PRELOAD,
        entry: Callable[[], None] = _run_clientapp_main,
    ) -> None:
        self.preload, self.entry = tuple(preload), entry
        self.pid: int | None = None
        self._socket: socket.socket | None = None
        self._stream: Any = None

    def start(self) -> ForkServer:
        """Fork the server (it imports ``preload``, then serves); return self."""
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the fork server
            ours.close()
            code = 0
            try:
                _serve(theirs, self.preload, self.entry)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            os._exit(code)
        theirs.close()
        self.pid, self._socket = pid, ours
        self._stream = ours.makefile("rwb")
        return self

    def launch(self, argv: Sequence[str], quiet: bool = False) -> int:
        """Fork a task running the program ``argv``; its pid (OSError: server gone)."""
        if self._stream is None:
            raise OSError("fork server not started")
        request = {"argv": list(argv), "quiet": quiet}
        self._stream.write(json.dumps(request).encode() + b"\n")
        self._stream.flush()
        reply = self._stream.readline()
        if not reply:
            raise OSError("fork server closed its socket")
        return int(json.loads(reply)["pid"])

    def close(self) -> None:
        """Close the socket (the server exits) and reap the server."""
        if self._socket is not None:
            self._stream.close()
            self._socket.close()
            self._socket = self._stream = None
        if self.pid is not None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.pid = None


class _ForkingSubprocess:
    """Stand-in for the ``subprocess`` module of Flower's SubprocessExecutor."""

    def __init__(self, real: ModuleType, server: ForkServer) -> None:
        self._real, self._server = real, server

    def Popen(self, args: Any, *rest: Any, **kwargs: Any) -> Any:  # noqa: N802
        if (
            isinstance(args, list)
            and args
            and args[0] == CLIENTAPP_COMMAND
            and not rest
        ):
            quiet = kwargs.get("stdout") is self._real.DEVNULL
            try:
                return self._server.launch([str(a) for a in args], quiet=quiet)
            except (OSError, ValueError) as error:
                LOGGER.warning(
                    "fork server unavailable (%s); starting %s", error, args[0]
                )
        return self._real.Popen(args, *rest, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def install(module: ModuleType, server: ForkServer) -> bool:
    """Route ``module``'s ``flwr-clientapp`` launches to ``server`` (else False).

    ``module`` is ``flwr.supercore.superexec.executor.subprocess_executor``
    (tests pass a stand-in): it must launch through its global ``subprocess``.
    """
    if isinstance(getattr(module, "subprocess", None), _ForkingSubprocess):
        return True
    if getattr(module, "subprocess", None) is not subprocess:
        LOGGER.warning(
            "fedadapt superexec: this Flower's SuperExec does not launch tasks "
            "as expected (flwr 1.41/1.42); starting each ClientApp as Flower does"
        )
        return False
    module.subprocess = _ForkingSubprocess(subprocess, server)  # type: ignore[attr-defined]
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fedadapt.tools.deploy.superexec [flower-superexec flags]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    server = ForkServer().start()  # before Flower's imports open anything
    try:
        flower_superexec = flower_program("flower-superexec")
        executor: ModuleType | None
        try:
            executor = importlib.import_module(EXECUTOR_MODULE)
        except ImportError:  # a Flower without executors: Flower's launches
            executor = None
        if executor is None or not install(executor, server):
            server.close()
        sys.argv = ["flower-superexec", *args]
        flower_superexec()
    finally:
        server.close()


if __name__ == "__main__":
    main()
