"""The ``flwr`` CLI without a fresh Python for every call (#39).

A ``flwr ls`` or ``flwr run`` is a Python process that spends ~0.9 CPU-s
importing Flower's CLI and milliseconds asking the SuperLink. A suite
submits each cell with ``flwr run`` and asks ``flwr ls`` once it ended, so
on a 2-core machine that import was paid twice on the next cell's start-up.

Here a helper process (:func:`main`, one per process that calls ``flwr``)
imports Flower's CLI once and forks a child for every call: each call is
still its own process, with its own environment, folder, output, exit code
and timeout, nothing left over from the call before, and runs Flower's
``flwr`` console-script entry point with the call's arguments, as the
program would (the SuperNode's warm ClientApp tasks are started the same
way: :mod:`fedadapt.tools.deploy.superexec`). The helper's input pipe is its
lifeline: when the process that started it ends, however it ends, the
helper reads end-of-file, kills the calls still running and exits.

Used only where it is the same Flower as the ``flwr`` program (the program
beside this interpreter) and ``os.fork`` exists; elsewhere, with
``FEDADAPT_FLWR_SUBPROCESS=1``, or once the helper has failed, each call is
the ``flwr`` program.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from fedadapt.tools.deploy.superexec import _run_task, flower_program

#: Set to 1 to run every call as the ``flwr`` program (a new Python each).
SUBPROCESS_ENV = "FEDADAPT_FLWR_SUBPROCESS"

#: Seconds the helper waits for a reply before it counts as failed.
HELPER_REPLY_S = 60.0


class HelperFailed(RuntimeError):
    """The helper could not start the call (it died, or never started)."""


class CallLost(RuntimeError):
    """The helper ended while the call ran (the call was killed)."""


class _Helper:
    """The client end: sends calls, routes the helper's replies by call id."""

    def __init__(self) -> None:
        # each call brings its own environment; FLWR_HOME here would only make
        # the helper look like one of that home's processes
        env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
        # -P: the caller's folder is not put first on sys.path (a checkout of
        # another fedadapt there would be imported instead of the installed
        # one); this fedadapt's root goes last, found only where no fedadapt
        # is installed (a checkout run in place), and shadowing nothing
        ours = str(Path(__file__).resolve().parents[3])
        code = (
            f"import sys; sys.path.append({ours!r}); import {__name__} as m; m.main()"
        )
        self.process = subprocess.Popen(
            # -c, not -m: click names the program after a __main__ module's
            # spec ("python -m ..."), after sys.argv[0] ("flwr") without one
            [sys.executable, "-P", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._ids = itertools.count(1)
        self._write = threading.Lock()
        self._waiting: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.alive = True
        reader = threading.Thread(
            target=self._read, name="flwr-cli-helper", daemon=True
        )
        reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:
                reply = json.loads(line)  # a line cut short: ValueError
                waiting = self._waiting.get(reply["id"])
                if waiting is not None:
                    waiting.put(reply)
        except ValueError:
            pass  # the helper died mid-reply: it is gone all the same
        finally:  # no call may wait for a helper that is gone
            self.alive = False
            self.process.stdout.close()
            for waiting in list(self._waiting.values()):
                waiting.put({"failed": "the helper ended"})

    def call(
        self, args: Sequence[str], env: Mapping[str, str], out: Path, err: Path,
        timeout: float | None,
    ) -> int:  # fmt: skip
        """Run one call in a child of the helper; return its exit code.

        :class:`HelperFailed` if the call never started (the caller may run
        it as the program); :class:`CallLost` if the helper ended while it
        ran (it is killed, and not run again: a ``flwr run`` may have
        submitted its run already).
        """
        call_id = next(self._ids)
        replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._waiting[call_id] = replies
        request = {"id": call_id, "args": list(args), "env": dict(env)}
        request |= {"out": str(out), "err": str(err), "cwd": os.getcwd()}
        started: dict[str, Any] | None = None
        try:
            with self._write:
                if not self.alive or self.process.stdin is None:
                    raise HelperFailed("the helper ended")
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            started = _reply(replies, HELPER_REPLY_S)
            try:
                return int(_reply(replies, timeout)["code"])
            except queue.Empty:  # past the call's timeout
                _kill(started["pid"])
                with contextlib.suppress(queue.Empty, HelperFailed):
                    _reply(replies, HELPER_REPLY_S)  # it was reaped
                raise subprocess.TimeoutExpired(
                    ["flwr", *args], timeout or 0.0
                ) from None
        except (OSError, queue.Empty, HelperFailed) as error:
            self.alive = False
            if started is None:
                raise HelperFailed(f"the helper did not answer: {error!r}") from error
            _kill(started["pid"])
            raise CallLost(
                f"the flwr CLI helper ended during the call ({error})"
            ) from error
        finally:
            del self._waiting[call_id]

    def close(self) -> None:
        """End the helper (end of file on its input) and wait for it."""
        with self._write:
            self.alive = False
            if self.process.stdin is not None:
                # a request a dead helper never read may still be buffered:
                # flushing it fails, and the pipe is closed all the same
                with contextlib.suppress(BrokenPipeError):
                    self.process.stdin.close()
        try:
            self.process.wait(timeout=HELPER_REPLY_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _reply(
    replies: queue.Queue[dict[str, Any]], timeout: float | None
) -> dict[str, Any]:
    reply = replies.get(timeout=timeout)
    if "failed" in reply:
        raise HelperFailed(reply["failed"])
    return reply


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_lock = threading.Lock()
_helper: _Helper | None = None
_helper_failed = False


def _the_helper(program: str) -> _Helper | None:
    """Return the helper (started on first use), or None where it cannot stand in."""
    global _helper, _helper_failed
    with _lock:
        if _helper is not None and _helper.alive:
            return _helper
        if _helper is not None:  # it ended: calls are plain processes from now
            _helper, _helper_failed = None, True
        if (
            _helper_failed
            or os.environ.get(SUBPROCESS_ENV) == "1"
            or not hasattr(os, "fork")
            or Path(program) != Path(sys.executable).parent / "flwr"
        ):
            return None
        try:
            _helper = _Helper()
        except OSError:
            _helper_failed = True
        else:  # ended before this process exits, not just after
            atexit.unregister(close)
            atexit.register(close)
        return _helper


def close() -> None:
    """End the helper, if one was started; the next call starts a new one."""
    global _helper, _helper_failed
    with _lock:
        helper, _helper, _helper_failed = _helper, None, False
    if helper is not None:
        helper.close()


def run_flwr(
    program: str,
    args: Sequence[str],
    env: Mapping[str, str],
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``program args`` in ``env``; return its exit code and output.

    As ``subprocess.run(..., capture_output=True, text=True)`` would, with
    :class:`subprocess.TimeoutExpired` after ``timeout`` seconds (the call
    is killed first).
    """
    command = [program, *args]
    helper = _the_helper(program)
    if helper is not None:
        with tempfile.TemporaryDirectory(prefix="fedadapt-flwr-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            try:
                code = helper.call(args, env, out, err, timeout)
            except HelperFailed:
                pass  # it never started: run it as the program below
            except CallLost as lost:  # failed as a killed program would
                return subprocess.CompletedProcess(
                    command, 1, _text(out), f"{_text(err)}\nfedadapt: {lost}\n"
                )
            else:
                return subprocess.CompletedProcess(
                    command, code, _text(out), _text(err)
                )
    return _run_program(command, env, timeout)


def _run_program(
    command: list[str], env: Mapping[str, str], timeout: float | None
) -> subprocess.CompletedProcess[str]:
    """Run the call as the ``flwr`` program: a new Python process."""
    return subprocess.run(
        command, env=dict(env), capture_output=True, text=True, check=False,
        timeout=timeout,
    )  # fmt: skip


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


# --- the helper process ---------------------------------------------------


def serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """Fork a child per request line until end of file; report pids and codes.

    Replies are JSON lines: ``{"id", "pid"}`` when a call's child started,
    ``{"id", "code"}`` when it ended (a negative code: killed by that
    signal). At end of file the children still running are killed.
    """
    entry = flower_program("flwr")  # Flower's CLI, imported once for all calls

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C ends us
    children: dict[int, int] = {}
    fd = requests.fileno()
    pending = b""

    def answer(reply: dict[str, Any]) -> None:
        replies.write((json.dumps(reply) + "\n").encode())
        replies.flush()

    while True:
        readable, _, _ = select.select([fd], [], [], 0.02 if children else None)
        while children:  # reap what ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            answer({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # the caller is gone
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(entry, request)  # never returns
            children[pid] = request["id"]
            answer({"id": request["id"], "pid": pid})
    for pid in children:
        _kill(pid)
    for pid in list(children):
        os.waitpid(pid, 0)


def _child(entry: Callable[[], Any], request: dict[str, Any]) -> None:
    """In a call's child: its environment, folder, files, then ``flwr``.

    Output is redirected at the descriptor level (Flower prints JSON to
    ``sys.__stdout__``); the program runs as the SuperNode's warm ClientApp
    tasks do (:func:`fedadapt.tools.deploy.superexec._run_task`: the exit
    code of its ``sys.exit``, a traceback and 1 if it raises).
    """
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        code = _run_task(entry, ["flwr", *request["args"]], quiet=False)
    except BaseException:  # noqa: BLE001 - reported as the program would
        traceback.print_exc()
    finally:
        os._exit(code)


def main() -> None:
    """Run the helper: serve the calls that arrive on standard input."""
    serve(sys.stdin.buffer, sys.stdout.buffer)
