"""The warm SuperExec: ClientApp processes forked with Flower imported (#40)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedadapt.tools.deploy import superexec
from fedadapt.tools.deploy.superexec import ForkServer, install


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _first_object_pull_retry() -> float | None:
    """The first retry of Flower's object pull as this process has it."""
    utils = sys.modules.get("flwr.supercore.inflatable.inflatable_utils")
    if utils is None:
        return None
    return utils.pull_and_inflate_object_from_tree.__kwdefaults__["initial_backoff"]


def _report_task() -> None:
    """A task: records its argv, pid, parent and the modules it found imported."""
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    print("task says hello", flush=True)
    record = {
        "argv": sys.argv,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "preloaded": "email.mime.text" in sys.modules,
        "object_pull_retry_s": _first_object_pull_retry(),
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(out)
    code = sys.argv[sys.argv.index("--exit") + 1]
    if code == "raise":
        raise RuntimeError("a task that fails")
    sys.exit(int(code))


@pytest.fixture
def server():
    fork = ForkServer(preload=("email.mime.text",), entry=_report_task).start()
    yield fork
    fork.close()


def _launch(
    server: ForkServer, tmp_path: Path, name: str, code: str = "0", quiet=False
):
    out = tmp_path / f"{name}.json"
    argv = ["flwr-clientapp", "--token", name, "--out", str(out), "--exit", code]
    pid = server.launch(argv, quiet=quiet)
    assert _wait_for(out.exists), f"task {name} wrote nothing"
    return pid, json.loads(out.read_text())


def test_each_launch_is_a_new_process_with_the_preload_done(server, tmp_path):
    first_pid, first = _launch(server, tmp_path, "a")
    second_pid, second = _launch(server, tmp_path, "b", code="3")
    assert first["pid"] == first_pid and second["pid"] == second_pid
    assert first_pid != second_pid != server.pid
    assert first["ppid"] == second["ppid"] == server.pid  # forked by the server
    assert first["argv"][:3] == ["flwr-clientapp", "--token", "a"]
    assert first["preloaded"] and second["preloaded"]
    # each task asks again for a missing object of its message after 0.05 s,
    # not Flower's 1 s (fedadapt.server.object_pull)
    assert first["object_pull_retry_s"] == second["object_pull_retry_s"] == 0.05
    # both exit and are reaped (no zombies pile up under the server)
    assert _wait_for(lambda: not _pid_alive(first_pid) and not _pid_alive(second_pid))


def test_a_crashing_task_leaves_the_server_serving(server, tmp_path):
    crashed, _ = _launch(server, tmp_path, "crash", code="raise")
    assert _wait_for(lambda: not _pid_alive(crashed))
    _, after = _launch(server, tmp_path, "after")
    assert after["ppid"] == server.pid


def test_the_server_ends_when_its_superexec_closes_it(tmp_path):
    fork = ForkServer(preload=(), entry=_report_task).start()
    pid = fork.pid
    assert pid is not None and _pid_alive(pid)
    fork.close()
    assert not _pid_alive(pid)
    with pytest.raises(OSError):
        fork.launch(["flwr-clientapp"])


def test_install_routes_clientapp_launches_only(server, tmp_path, monkeypatch):
    module = type(sys)("fake_executor")
    module.subprocess = subprocess
    assert install(module, server)
    assert install(module, server)  # idempotent
    out = tmp_path / "routed.json"
    pid = module.subprocess.Popen(
        ["flwr-clientapp", "--out", str(out), "--exit", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert isinstance(pid, int)
    assert _wait_for(out.exists)
    assert json.loads(out.read_text())["ppid"] == server.pid
    # any other program is Flower's Popen, unchanged
    other = module.subprocess.Popen([sys.executable, "-c", "pass"])
    assert isinstance(other, subprocess.Popen)
    assert other.wait(timeout=30) == 0
    # a server that is gone: the launch falls back to a real process
    server.close()
    called = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: called.append(a) or "real")
    assert module.subprocess.Popen(["flwr-clientapp", "--x"]) == "real"
    assert called == [(["flwr-clientapp", "--x"],)]


def test_install_refuses_a_module_that_launches_otherwise(server):
    module = type(sys)("other_executor")
    module.subprocess = object()
    assert not install(module, server)


def test_flowers_executor_launches_through_its_subprocess_global():
    """Fails when a Flower release changes how its SuperExec starts tasks."""
    import inspect

    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType
    from flwr.supercore.superexec.executor import subprocess_executor

    assert subprocess_executor.subprocess is subprocess
    assert TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP] == superexec.CLIENTAPP_COMMAND
    assert "subprocess.Popen(" in inspect.getsource(subprocess_executor)


def test_the_server_ends_when_its_superexec_is_killed():
    """SIGKILL leaves no fork server behind: the socket's EOF ends it."""
    code = (
        "import time\n"
        "from fedadapt.tools.deploy.superexec import ForkServer\n"
        "server = ForkServer(preload=()).start()\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert _pid_alive(server_pid)
    finally:
        owner.kill()
        owner.wait(timeout=30)
    assert _wait_for(lambda: not _pid_alive(server_pid))


def test_a_profile_folder_gets_each_tasks_profile(tmp_path, monkeypatch):
    import pstats

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    monkeypatch.setenv(superexec.PROFILE_ENV, str(profiles))
    fork = ForkServer(preload=(), entry=_report_task).start()
    try:
        pid, _ = _launch(fork, tmp_path, "profiled")
    finally:
        fork.close()
    written = profiles / f"clientapp-{pid}.prof"
    assert _wait_for(lambda: not _pid_alive(pid))  # written before it exits
    assert written.exists()
    functions = {name for _, _, name in pstats.Stats(str(written)).stats}
    assert "_report_task" in functions
