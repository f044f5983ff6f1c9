"""#39: ``flwr`` calls forked from a helper that imported Flower's CLI once.

Oracle: the ``flwr`` program itself (a new Python per call, as before):
every call through the helper gives its exit code, stdout and stderr to the
byte. And /proc: nothing the helper starts outlives its caller or a timeout.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedadapt.tools.deploy import flwr_cli
from fedadapt.tools.deploy.process import program, write_connection

FLWR = program("flwr")


@pytest.fixture
def helper(monkeypatch):
    """A fresh helper for the test; calls may not fall back to the program."""
    flwr_cli.close()

    def no_program(*args):
        raise AssertionError("the call ran as the flwr program, not in the helper")

    monkeypatch.setattr(flwr_cli, "_run_program", no_program)
    yield
    flwr_cli.close()


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0"}


def _program(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    done = subprocess.run(
        [FLWR, *args], env=env, capture_output=True, text=True, check=False
    )
    return done.returncode, done.stdout, done.stderr


def _helped(args: list[str], env: dict[str, str], **kw) -> tuple[int, str, str]:
    done = flwr_cli.run_flwr(FLWR, args, env, **kw)
    return done.returncode, done.stdout, done.stderr


def test_a_call_gives_exactly_what_the_flwr_program_gives(tmp_path, helper):
    home = tmp_path / "home"
    write_connection(home, "here", "127.0.0.1:9")
    env = _env(home)
    calls = [
        ["--version"],
        ["--help"],
        ["config", "list"],  # reads $FLWR_HOME/config.toml
        ["ls", "nowhere", "--format", "json"],  # JSON error, exit code 0
        ["ls", "nowhere"],  # exit code 1, message on stderr
        ["no-such-command"],  # click's usage error, exit code 2
    ]
    helped = [_helped(args, env) for args in calls]
    for args, got in zip(calls, helped, strict=True):
        want = _program(args, env)
        assert got == want, args
    assert {code for code, _, _ in helped} == {0, 1, 2}
    assert "here" in helped[2][1]


def test_each_call_has_its_own_environment_even_at_once(tmp_path, helper):
    homes = [tmp_path / f"home{k}" for k in range(6)]
    for k, home in enumerate(homes):
        write_connection(home, f"link-{k}", "127.0.0.1:9")
    results: dict[int, tuple[int, str, str]] = {}

    def call(k: int) -> None:
        results[k] = _helped(["config", "list"], _env(homes[k]))

    threads = [threading.Thread(target=call, args=(k % 6,)) for k in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for k in range(6):
        code, out, _ = results[k]
        listed = {n for n in range(6) if f"link-{n}" in out}
        assert (code, listed) == (0, {k})


def test_a_call_past_its_timeout_is_killed(tmp_path, helper):
    """A SuperLink that accepts and never answers: the call is killed."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        home = tmp_path / "home"
        write_connection(home, "hole", f"127.0.0.1:{hole.getsockname()[1]}")
        raised: list[BaseException] = []

        def call() -> None:
            try:
                _helped(["ls", "hole", "--format", "json"], _env(home), timeout=2.0)
            except subprocess.TimeoutExpired as error:
                raised.append(error)

        waiting = threading.Thread(target=call, daemon=True)
        waiting.start()
        waiting.join(timeout=60)  # a timeout that is not enforced fails, not hangs
        assert not waiting.is_alive() and raised
        helper_pid = flwr_cli._helper.process.pid
        children = subprocess.run(
            ["ps", "--ppid", str(helper_pid), "-o", "pid="],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert children == []
        # and the helper still serves the next call
        assert _helped(["--version"], _env(home)) == _program(["--version"], _env(home))


CALLER = """
import os, sys, time
from fedadapt.tools.deploy import flwr_cli
from fedadapt.tools.deploy.process import program
done = flwr_cli.run_flwr(program("flwr"), ["--version"], dict(os.environ))
print(flwr_cli._helper.process.pid, done.returncode, flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _caller(how: str) -> tuple[subprocess.Popen, int]:
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, how], stdout=subprocess.PIPE, text=True
    )
    assert caller.stdout is not None
    helper_pid, code = map(int, caller.stdout.readline().split())
    assert code == 0
    return caller, helper_pid


def test_the_helper_has_ended_when_its_caller_exits():
    caller, helper_pid = _caller("exit")
    assert caller.wait(timeout=60) == 0
    assert not _alive(helper_pid)  # at once: the caller ended it at exit


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_helper_ends_when_its_caller_is_killed(how):
    caller, helper_pid = _caller("wait")
    assert _alive(helper_pid)
    caller.send_signal(how)
    caller.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(helper_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper_pid)


@pytest.fixture
def programs_run(monkeypatch):
    """A fresh helper; the calls that ran as the flwr program, listed."""
    flwr_cli.close()
    ran: list[list[str]] = []
    real_run = flwr_cli._run_program

    def program_run(command, env, timeout):
        ran.append(command)
        return real_run(command, env, timeout)

    monkeypatch.setattr(flwr_cli, "_run_program", program_run)
    yield ran
    flwr_cli.close()


@pytest.mark.parametrize("end_seen", [True, False], ids=["end-seen", "end-unseen"])
def test_calls_go_on_as_the_program_once_the_helper_is_gone(
    tmp_path, programs_run, end_seen
):
    """``end-unseen``: the next call writes to the dead helper before the
    reader has seen its end (a race CI lost): the write's broken pipe makes
    it run as the program, and closing the helper's input later must not
    raise on the request still buffered there."""
    ran = programs_run
    env = _env(tmp_path / "home")
    try:
        assert _helped(["--version"], env) == _program(["--version"], env)
        assert ran == []  # the helper ran it
        helper = flwr_cli._helper
        os.kill(helper.process.pid, signal.SIGKILL)
        helper.process.wait()
        if not end_seen:
            deadline = time.monotonic() + 30
            while helper.alive and time.monotonic() < deadline:
                time.sleep(0.01)
            helper.alive = True  # as if the reader had not got there yet
        assert _helped(["--version"], env) == _program(["--version"], env)
        assert ran == [[FLWR, "--version"]]
    finally:
        flwr_cli.close()


def test_a_call_the_helper_dies_under_fails_and_is_not_run_again(
    tmp_path, programs_run
):
    """A ``flwr run`` may have submitted its run before the helper died:
    running it again as the program would submit it twice. The call fails,
    its process is killed; only the calls after it run as the program."""
    ran = programs_run
    results: list[tuple[int, str, str]] = []
    try:
        with socket.socket() as hole:
            hole.bind(("127.0.0.1", 0))
            hole.listen(8)
            home = tmp_path / "home"
            write_connection(home, "hole", f"127.0.0.1:{hole.getsockname()[1]}")
            env = _env(home)
            assert _helped(["--version"], env)[0] == 0  # the helper is up
            hanging = threading.Thread(
                target=lambda: results.append(_helped(["ls", "hole"], env))
            )
            hanging.start()
            helper_pid = flwr_cli._helper.process.pid
            deadline = time.monotonic() + 30
            calls: list[str] = []
            while not calls and time.monotonic() < deadline:  # the call started
                calls = subprocess.run(
                    ["ps", "--ppid", str(helper_pid), "-o", "pid="],
                    capture_output=True,
                    text=True,
                ).stdout.split()
                time.sleep(0.05)
            assert calls
            os.kill(helper_pid, signal.SIGKILL)
            hanging.join(timeout=60)
        code, _, err = results[0]
        assert code == 1 and "helper ended during the call" in err
        assert ran == []  # not run again as the program
        deadline = time.monotonic() + 30
        while _alive(int(calls[0])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(int(calls[0]))  # the orphaned call was killed
        assert _helped(["--version"], env) == _program(["--version"], env)
        assert ran == [[FLWR, "--version"]]
    finally:
        flwr_cli.close()


def test_the_program_runs_each_call_where_asked(tmp_path, monkeypatch):
    """FEDADAPT_FLWR_SUBPROCESS=1, or a flwr that is not this Python's."""
    flwr_cli.close()
    monkeypatch.setenv(flwr_cli.SUBPROCESS_ENV, "1")
    assert flwr_cli._the_helper(FLWR) is None
    monkeypatch.delenv(flwr_cli.SUBPROCESS_ENV)
    assert flwr_cli._the_helper(str(tmp_path / "flwr")) is None
    assert flwr_cli._helper is None
    env = _env(tmp_path / "home")
    assert _helped(["--version"], env) == _program(["--version"], env)
    flwr_cli.close()


def test_a_reply_cut_short_ends_the_helper_and_frees_the_waiting_calls():
    """A helper killed in the middle of a reply line: the calls waiting for
    it are told it ended (they would wait without end for a code)."""

    class Gone:
        stdout = io.BytesIO(b'{"id": 1, "pid": 7}\n{"id": 1, "co')

    helper = object.__new__(flwr_cli._Helper)
    helper.process, helper.alive = Gone(), True
    waiting: queue.Queue = queue.Queue()
    helper._waiting = {1: waiting}
    helper._read()
    assert not helper.alive
    assert waiting.get_nowait() == {"id": 1, "pid": 7}
    assert waiting.get_nowait() == {"failed": "the helper ended"}
