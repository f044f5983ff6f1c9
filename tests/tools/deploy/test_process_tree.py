"""Issue #26 part 1: a ProcessTree finds and ends what left the process group.

Oracle: /proc itself. A daemon that double-forks into its own session (its
parent exits, it is re-parented to PID 1, as Ray's GCS/raylet and Flower's
SuperExec are) escapes ``killpg`` of the group it was started in; the tree
still finds it by the token in its environment, and ends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedadapt.tools.deploy.process import ProcessesLeftError, ProcessTree, raise_if_left

ESCAPE = """
import os, sys, time
if os.fork():
    sys.exit(0)
os.setsid()  # its own session, parent gone: re-parented
leader = os.getpid()
if os.fork():
    sys.exit(0)
while os.getppid() == leader:  # until the session leader has exited too
    time.sleep(0.01)
print(os.getpid(), flush=True)
signal_proof = sys.argv[1] == "stubborn"
if signal_proof:
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
"""


def _start(tree: ProcessTree, kind: str) -> int:
    """Start an escaping daemon; return its pid (it is no longer in the group
    of the process the tree started, which has exited)."""
    starter = subprocess.Popen(
        [sys.executable, "-c", ESCAPE, kind],
        env=tree.env(dict(os.environ)),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert starter.stdout is not None
    pid = int(starter.stdout.readline())  # printed by the escaped grandchild
    starter.stdout.close()
    starter.wait(timeout=30)  # the starter itself exited at once
    assert os.getpgid(pid) != starter.pid  # killpg(starter's group) misses it
    return pid


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_tree_finds_and_ends_processes_that_left_their_group():
    tree = ProcessTree()
    polite, stubborn = _start(tree, "polite"), _start(tree, "stubborn")
    try:
        assert sorted(tree.pids()) == sorted([polite, stubborn])
        assert ProcessTree().pids() == {}  # another tree's token finds nothing
        left = tree.stop(grace=1.0)  # SIGTERM, then SIGKILL for the stubborn one
        assert left == {}
        deadline = time.monotonic() + 5
        while (_alive(polite) or _alive(stubborn)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(polite) and not _alive(stubborn)
    finally:
        for pid in (polite, stubborn):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


ORPHAN = """
import os, subprocess, sys, time
child = subprocess.Popen(  # no token: found only as this process's child
    ["sh", "-c", "trap '' TERM; echo ready; exec sleep 600"],
    env={"PATH": os.environ["PATH"]},
    stdout=subprocess.PIPE,
    text=True,
)
child.stdout.readline()  # its SIGTERM is ignored from here on
print(child.pid, flush=True)
time.sleep(600)  # dies of SIGTERM; the child is re-parented out of the tree
"""


def test_a_child_orphaned_while_stopping_is_still_stopped():
    """The CI failure of stop 52: processes outlived a stopped run after
    their parent died first. A child without the token ignores SIGTERM; its
    parent dies of it and the child leaves the tree. The stop still kills it."""
    tree = ProcessTree()
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN],
        env=tree.env(dict(os.environ)),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert sorted(tree.pids()) == sorted([parent.pid, child])
        assert tree.stop(grace=1.0) == {}
        parent.wait(timeout=5)
        assert parent.returncode == -signal.SIGTERM  # the parent died first
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        for pid in (parent.pid, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.stdout.close()
        parent.wait(timeout=5)


def test_what_cannot_be_stopped_is_named():
    try:
        raise_if_left({42: "raylet --flag"})
    except ProcessesLeftError as error:
        assert "1 processes started here are still running" in str(error)
        assert "42: raylet --flag" in str(error)
    else:
        raise AssertionError("no error")
    raise_if_left({})  # nothing left: nothing raised


def test_flowers_programs_are_found_on_path_when_not_beside_python(
    tmp_path, monkeypatch
):
    """#42: an install with ``pip install --target`` or a launcher wrapper has
    no flower-superlink beside ``sys.executable``; PATH has it."""
    import stat
    import sys

    from fedadapt.tools.deploy import process

    bare, tools = tmp_path / "bare-python", tmp_path / "tools"
    bare.mkdir()
    tools.mkdir()
    script = tools / "flower-superlink"
    script.write_text("#!/bin/sh\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(bare / "python"))
    monkeypatch.setenv("PATH", str(tools))
    assert process.program("flower-superlink") == str(script)
    with pytest.raises(FileNotFoundError, match="flower-supernode not found"):
        process.program("flower-supernode")
    # in a venv, its own copy wins over PATH
    (bare / "flower-superlink").write_text("#!/bin/sh\n")
    (bare / "flower-superlink").chmod(0o755)
    assert process.program("flower-superlink") == str(bare / "flower-superlink")
