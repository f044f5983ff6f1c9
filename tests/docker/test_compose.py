"""The compose deployment, run for real: containers driven by ``flwr run`` (issue #11).

Each test brings up docker/compose.yaml (a SuperLink and three SuperNodes,
each its own container and host on the compose network) under its own
project name, submits the app from the host to the SuperLink port published
on 127.0.0.1, checks the run's real outcome and results.json in the mounted
folder, and takes everything down (``down -v``), checking nothing remains.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from fedadapt.cli import run_status, submit_run
from fedadapt.deploy.certs import make_certificates, make_node_keys, public_key_path
from fedadapt.deploy.process import (
    flower_env,
    flwr,
    online_supernodes,
    write_connection,
)
from tests.helpers import ROOT

pytestmark = pytest.mark.docker

RUN = {
    "task": "digits-mlp",
    "strategy": "fedadam",
    "clients-per-round": 3,
    "local-steps": 5,
    "output-dir": "/results",
}


def _wait_online(project, connection, count, timeout=120):
    """Wait until the SuperLink answers and lists ``count`` SuperNodes online."""
    env = flower_env(connection.flwr_home)
    write_connection(
        connection.flwr_home, connection.connection, connection.address,
        connection.root_certificates,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        online = online_supernodes(env, connection.connection)
        if online is not None and len(online) >= count:
            return
        time.sleep(1)
    raise TimeoutError(f"{count} SuperNodes not online:\n{project('ps')}")


def _run(project, connection, rounds, timeout=400):
    outcome = submit_run(
        connection, ROOT, {**RUN, "num-server-rounds": rounds}, 3, timeout,
        results_dir=project.results,
    )  # fmt: skip
    assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
    data = json.loads(outcome.results.read_text())
    assert data["status"] == "completed" and len(data["rounds"]) == rounds
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
    return outcome, data


def test_compose_run_superlink_restart_and_node_loss(project):
    """2 rounds; the SuperLink restarts keeping run 1; a SuperNode stops mid-run."""
    project("up", "-d")
    connection = project.connection()
    _wait_online(project, connection, 3)
    first, data = _run(project, connection, rounds=2)
    assert all(r["replies"]["used"] == 3 for r in data["rounds"])

    # the SuperLink's state lives in the named volume: run 1 survives a restart
    project("restart", "superlink")
    _wait_online(project, connection, 3)
    env = flower_env(connection.flwr_home)
    assert run_status(first.run_id, env, connection.connection)["status"] == (
        "finished:completed"
    )

    # node loss: stop supernode-3 once run 2 has started training
    def stop_when_started():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for path in project.results.glob("*/results.json"):
                try:
                    info = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                if info.get("run_id") != first.run_id and info.get("initial"):
                    project("stop", "supernode-3")
                    return
            time.sleep(0.2)

    stopper = threading.Thread(target=stop_when_started, daemon=True)
    stopper.start()
    _, data = _run(project, connection, rounds=3)
    stopper.join(timeout=60)
    rounds = data["rounds"]
    assert sum(r["replies"]["failed"] for r in rounds) >= 1  # the lost reply
    assert rounds[-1]["replies"]["used"] == 2
    assert rounds[-1]["nodes"]["train"] == {"wanted": 3, "connected": 2}


def test_compose_tls_and_supernode_authentication(project):
    """TLS override: certificates mounted read-only, only registered nodes join."""
    project.files.append("compose.tls.yaml")
    make_certificates(project.certs, ["superlink", "localhost", "127.0.0.1"])
    keys = make_node_keys(project.certs, 3)
    if os.getuid() == 0:  # the containers run as uid 1000 and read these
        for path in project.certs.iterdir():
            os.chown(path, 1000, 1000)
    connection = project.connection(root_certificates=project.certs / "ca.crt")
    project("up", "-d", "superlink")
    _wait_online(project, connection, 0)
    env = flower_env(connection.flwr_home)
    for key in keys:
        public = str(public_key_path(key))
        flwr(["supernode", "register", public, connection.connection], env)
    project("up", "-d")
    _wait_online(project, connection, 3)
    _run(project, connection, rounds=2)
    # the insecure CLI cannot talk to the TLS SuperLink
    write_connection(connection.flwr_home, "plain", connection.address)
    with pytest.raises(RuntimeError):
        flwr(["ls", "plain"], env)
