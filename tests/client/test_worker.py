"""The node's warm worker (fedadapt.client.worker) against the in-process ClientApp.

Oracle: the same train message handled in this process
(:func:`fedadapt.client.handlers.train`) gives bit-identical arrays, the
same metrics (clocks aside) and the same node state as through the worker;
an error in the worker is raised again here with its type and text. And the
worker's lifetime: it ends with its owner process and after its idle time,
and removes its socket.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from fedadapt.client import handlers, worker
from fedadapt.strategies import wire
from tests.client.harness import RUN_CONFIG, global_state

pytestmark = pytest.mark.app

CLOCKS = (wire.TRAIN_TIME_S, wire.PROCESS_AGE_S)


@pytest.fixture
def owner():
    """A stand-in for Flower's SuperExec: the worker lives while it does."""
    process = subprocess.Popen(["sleep", "300"])
    yield process
    process.kill()
    process.wait()


def _context(node: int = 7) -> Context:
    run_config = dict(RUN_CONFIG)
    node_config = {"partition-id": 1, "num-partitions": 3}
    return Context(1, node, node_config, RecordDict(), run_config)


def _train_content(server_round: int) -> RecordDict:
    # MOON keeps the node's previous local model in context.state
    config = ConfigRecord({wire.SERVER_ROUND: server_round, wire.LR: 0.05,
                           wire.LOCAL_UPDATE: "moon", "moon.mu": 1.0,
                           "moon.temperature": 0.5})  # fmt: skip
    return RecordDict({wire.ARRAYS: ArrayRecord(global_state()), wire.CONFIG: config})


def _worker_pids(owner_pid: int, node: int) -> list[int]:
    address = worker.WorkerAddress.for_node(node, owner_pid)
    text = address.log.read_text() if address.log.exists() else ""
    return [int(p) for p in re.findall(r"worker (\d+): listening", text)]


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not worker.alive(pid, None):
            return True
        # reap nothing: the worker is not our child once its starter returns
        time.sleep(0.2)
    return False


def _same_reply(here: RecordDict, there: RecordDict) -> None:
    assert set(here) == set(there)
    for name in here.array_records:
        mine, theirs = here[name], there[name]
        assert list(mine) == list(theirs)
        for key in mine:
            np.testing.assert_array_equal(mine[key].numpy(), theirs[key].numpy())
    for name in here.metric_records:
        strip = lambda r: {k: v for k, v in r.items() if k not in CLOCKS}  # noqa: E731
        assert strip(here[name]) == strip(there[name])


def test_worker_trains_exactly_as_the_process_would_and_keeps_the_state(
    owner, monkeypatch
):
    monkeypatch.setenv("FEDADAPT_WORKER_IDLE_S", "120")
    here, there = _context(), _context()
    for server_round in (1, 2):  # round 2 uses the state round 1 left
        mine = handlers.train(_train_content(server_round), here)
        theirs = worker.call("train", _train_content(server_round), there, owner.pid)
        _same_reply(mine, theirs)
        assert list(here.state) == list(there.state) != []
        for name in here.state.array_records:
            for key, value in here.state[name].items():
                np.testing.assert_array_equal(
                    value.numpy(), there.state[name][key].numpy()
                )
    # both messages went to one worker, started once
    pids = _worker_pids(owner.pid, 7)
    assert len(pids) == 1 and worker.alive(pids[0], None)
    # it ends with its owner (the SuperExec, in a deployment), socket removed
    owner.kill()
    owner.wait()
    assert _gone(pids[0], within=10)
    assert not worker.WorkerAddress.for_node(7, owner.pid).socket.exists()


def test_worker_errors_are_raised_again_and_idle_workers_leave(owner, monkeypatch):
    monkeypatch.setenv("FEDADAPT_WORKER_IDLE_S", "2")
    context = _context(node=8)
    context.node_config.pop("partition-id")  # an unusable node config
    with pytest.raises(ValueError, match="node config lacks 'partition-id'"):
        worker.call("train", _train_content(1), context, owner.pid)
    (pid,) = _worker_pids(owner.pid, 8)
    assert worker.alive(pid, None)  # an error in a message ends nothing
    assert _gone(pid, within=15)  # but 2 idle seconds do


def test_a_worker_killed_mid_message_fails_it_and_the_next_starts_anew(
    owner, monkeypatch
):
    """SIGKILL during a message: that message fails at once, with the log's tail.

    It is not sent again (a second worker would only repeat a sure failure,
    e.g. out of memory); the node's next message starts a new worker over
    the dead one's stale socket and is answered.
    """
    monkeypatch.setenv("FEDADAPT_WORKER_IDLE_S", "120")
    context = _context(node=9)
    context.run_config["local-steps"] = 200_000  # ~a minute of training
    outcome: dict = {}

    def send() -> None:
        started = time.monotonic()
        try:
            worker.call("train", _train_content(1), context, owner.pid)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error
        outcome["took"] = time.monotonic() - started

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not _worker_pids(owner.pid, 9) and time.monotonic() < deadline:
        time.sleep(0.1)
    (pid,) = _worker_pids(owner.pid, 9)
    time.sleep(3)  # well into the message (imports, data, the first steps)
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the message did not fail with its worker"
    error = outcome.get("error")
    assert isinstance(error, worker.WorkerError), error
    assert "ended during the train message" in str(error)
    assert outcome["took"] < 40  # failed at once, not after a second worker's run
    assert _worker_pids(owner.pid, 9) == [pid]  # and was not sent again

    reply = worker.call("train", _train_content(1), _context(node=9), owner.pid)
    assert wire.ARRAYS in reply
    pids = _worker_pids(owner.pid, 9)
    assert len(pids) == 2 and pids[1] != pid and worker.alive(pids[1], None)


def test_only_flowers_one_message_process_uses_a_worker(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/venv/bin/flwr-clientapp", "--token", "x"])
    assert worker.uses_worker({})
    assert not worker.uses_worker({"client-worker": "off"})
    monkeypatch.setattr("sys.argv", ["/venv/bin/pytest"])
    assert not worker.uses_worker({})


def test_legacy_fit_and_evaluate_on_the_worker_equal_the_numpy_client(
    owner, monkeypatch
):
    from fedadapt.client.legacy_training import FedAdaptClient
    from fedadapt.client.numpy_client import WorkerClient

    monkeypatch.setenv("FEDADAPT_WORKER_IDLE_S", "60")
    here, there = _context(node=9), _context(node=9)
    client = FedAdaptClient(here.run_config, here.node_config, here.state, 9)
    params = [v.numpy() for v in global_state().values()]
    config = {wire.SERVER_ROUND: 1, wire.LR: 0.05}
    mine = client.fit(params, config)
    theirs = worker.call("legacy-fit", (params, config), there, owner.pid)
    assert len(mine[0]) == len(theirs[0]) and mine[1] == theirs[1]
    for a, b in zip(mine[0], theirs[0], strict=True):
        np.testing.assert_array_equal(a, b)
    strip = lambda m: {k: v for k, v in m.items() if k not in CLOCKS}  # noqa: E731
    assert strip(mine[2]) == strip(theirs[2])
    assert client.evaluate(params, {}) == worker.call(
        "legacy-evaluate", (params, {}), there, owner.pid
    )
    # the partition query needs no worker, and answers as the NumPyClient does
    for node_config in ({"partition-id": 2, "num-partitions": 5},
                        {"data-path": "/nodes/a"}):  # fmt: skip
        context = Context(1, 9, node_config, RecordDict(), dict(RUN_CONFIG))
        assert WorkerClient(context).get_properties({}) == (
            {} if "data-path" in node_config
            else FedAdaptClient(RUN_CONFIG, node_config).get_properties({})
        )  # fmt: skip


def test_a_node_data_error_comes_back_as_itself(owner, monkeypatch, tmp_path):
    """The one-line node error (node id and path) survives the worker."""
    from fedadapt.tasks.node_data import NodeDataError

    monkeypatch.setenv("FEDADAPT_WORKER_IDLE_S", "30")
    missing = tmp_path / "nowhere"

    def context() -> Context:
        return Context(1, 11, {"data-path": str(missing)}, RecordDict(),
                       dict(RUN_CONFIG))  # fmt: skip

    with pytest.raises(NodeDataError) as here:
        handlers.train(_train_content(1), context())
    with pytest.raises(NodeDataError) as there:
        worker.call("train", _train_content(1), context(), owner.pid)
    assert str(there.value) == str(here.value)
    assert str(there.value).startswith(f"node 11 data-path {missing}")


def test_sweep_removes_only_the_files_of_workers_that_are_gone(tmp_path):
    """A killed worker's socket, key and log go; a live or young one's stay.

    Oracle: processes whose state the test controls (one that has exited,
    this test's own) named as the listening pid in each log.
    """
    gone = subprocess.Popen(["true"])
    gone.wait()

    def files(name, pid, age):
        made = []
        for suffix in (".sock", ".key", ".log"):
            path = tmp_path / f"{name}{suffix}"
            text = f"worker {pid}: listening on {path}\n" if pid else "Traceback\n"
            path.write_text(text if suffix == ".log" else "x")
            os.utime(path, (time.time() - age, time.time() - age))
            made.append(path)
        return made

    killed = files("killed", gone.pid, 3600)  # SIGKILLed an hour ago
    crashed = files("crashed", None, 3600)  # died before it listened
    live = files("live", os.getpid(), 3600)  # a live worker, idle for long
    young = files("young", gone.pid, 5)  # its pid gone, but just written
    removed = worker.sweep_stale(tmp_path, min_age_s=60)
    assert sorted(removed) == sorted(killed + crashed)
    assert all(not p.exists() for p in killed + crashed)
    assert all(p.exists() for p in live + young)


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_socket_that_drops_the_handshake_counts_as_no_worker(tmp_path, how):
    """A killed worker's socket can still be held a moment by what it
    started: the connection is accepted, then dropped before the handshake.
    That is no worker (the node starts a new one), not a failed message."""
    import socket
    import struct

    address = worker.WorkerAddress(
        tmp_path / "w.sock", tmp_path / "w.key", tmp_path / "w.log"
    )
    address.key.write_bytes(b"k" * 32)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(address.socket))
    server.listen(1)

    def drop() -> None:
        conn, _ = server.accept()
        if how == "reset":  # an RST instead of an orderly close
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                            struct.pack("ii", 1, 0))  # fmt: skip
        conn.close()

    thread = threading.Thread(target=drop, daemon=True)
    thread.start()
    try:
        assert worker._connect(address) is None
    finally:
        thread.join(5)
        server.close()
