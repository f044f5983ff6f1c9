"""The compose deployment run for real: containers driven by ``flwr run`` (issue #11).

Each test brings up docker/compose.yaml (a SuperLink and three SuperNodes,
each its own container and host on the compose network, with its own data
partition) under a compose project of its own, submits the app from the host
with the venv's ``flwr`` to the SuperLink port published on 127.0.0.1, waits
for the run's real outcome (``flwr ls``: ``flwr run`` exits 0 even when a run
fails), checks results.json in the host folder mounted into the SuperLink,
and takes everything down (``down -v``), checking that nothing remains.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from fedadapt.tools.deploy.certs import (
    make_certificates,
    make_node_keys,
    public_key_path,
)
from fedadapt.tools.deploy.process import (
    flower_env,
    flwr,
    write_connection,
)
from fedadapt.tools.submission import submit_run
from tests.helpers import ROOT

pytestmark = pytest.mark.docker

# digits-mlp, an adaptive fedadapt strategy, small local work
RUN = {
    "task": "digits-mlp",
    "strategy": "feddua",
    "clients-per-round": 3,
    "local-steps": 5,
    "num-server-rounds": 2,
    "output-dir": "/results",  # the SuperLink container's mount of project.results
}


def _run(project, connection, timeout=400, overrides=None):
    """Submit one run, wait for its outcome; return it and its results.json."""
    config = {**RUN, **(overrides or {})}
    outcome = submit_run(
        connection, ROOT, config, 3, timeout, results_dir=project.results
    )
    assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
    data = json.loads(outcome.results.read_text())
    assert data["status"] == "completed"
    assert len(data["rounds"]) == RUN["num-server-rounds"]
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
    return outcome, data


def _listed_runs(connection) -> dict[int, str]:
    """Every run ``flwr ls`` lists: run id → status."""
    env = flower_env(connection.flwr_home)
    out = json.loads(flwr(["ls", connection.connection, "--format", "json"], env))
    return {int(r["run-id"]): r["status"] for r in out["runs"]}


def test_compose_demo_and_superlink_restart(project):
    """up -d, one flwr run: 3 SuperNodes train; the run survives a SuperLink restart."""
    project("up", "-d")
    connection = project.connection()
    project.wait_online(connection, 3)
    first, data = _run(project, connection)
    assert all(r["replies"]["used"] == 3 for r in data["rounds"])
    # results.json was written by the ServerApp inside the SuperLink container
    assert first.results.parent.parent == project.results

    # the SuperLink keeps its state in the named volume: run 1 is still listed
    project("restart", "superlink")
    project.wait_online(connection, 3)
    assert _listed_runs(connection)[first.run_id] == "finished:completed"


def test_compose_node_loss(project):
    """``docker stop`` of a SuperNode mid-run: the run completes, the loss recorded."""
    project("up", "-d")
    connection = project.connection()
    project.wait_online(connection, 3)
    victim = project.container("supernode-3")
    stopped = threading.Event()

    def stop_once_training():
        # the SuperNode starts a ClientApp process when its first message arrives
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            logs = subprocess.run(
                ["docker", "logs", victim], capture_output=True, text=True
            )
            if "Start `flwr-clientapp` process" in logs.stdout + logs.stderr:
                subprocess.run(["docker", "stop", victim], capture_output=True)
                stopped.set()
                return
            time.sleep(0.2)

    stopper = threading.Thread(target=stop_once_training, daemon=True)
    stopper.start()
    _, data = _run(project, connection)
    stopper.join(timeout=30)
    assert stopped.is_set(), "supernode-3 never started training"
    rounds = data["rounds"]
    lost = [r for r in rounds if r["replies"]["failed"] or "nodes" in r]
    assert lost, f"no failure recorded: {[r['replies'] for r in rounds]}"
    assert rounds[-1]["replies"]["used"] == 2
    assert rounds[-1]["nodes"]["train"] == {"wanted": 3, "connected": 2}


def test_compose_tls_and_supernode_authentication(project):
    """TLS override: certificates mounted read-only, only registered nodes join.

    Then a SecAgg+ run on the same private deployment.
    """
    project.use("compose.tls.yaml")
    make_certificates(project.certs, ["superlink", "localhost", "127.0.0.1"])
    keys = make_node_keys(project.certs, 3)
    if os.getuid() == 0:  # the containers run as uid 1000 and read these
        for path in project.certs.iterdir():
            os.chown(path, 1000, 1000)
    connection = project.connection(root_certificates=project.certs / "ca.crt")
    project("up", "-d", "superlink")
    project.wait_online(connection, 0)

    # a SuperNode whose key is not registered is refused (Flower's exit code
    # 305, which the process reports as 305 % 256)
    refused = subprocess.run(
        project.command("run", "--rm", "--no-deps", "-T", "supernode-1"),
        env=project.env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-3000:]
    assert "Exit Code: 305" in output and "Failed to activate SuperNode" in output

    env = flower_env(connection.flwr_home)
    for key in keys:
        flwr(
            ["supernode", "register", str(public_key_path(key)), connection.connection],
            env,
        )
    project("up", "-d")
    project.wait_online(connection, 3)
    _, data = _run(project, connection)
    assert all(r["replies"]["used"] == 3 for r in data["rounds"])

    # SecAgg+ across the containers (issue #41 item 5): the default apps hand
    # the run to Flower's legacy workflow; the strategy steps on the revealed
    # sums, within their error bound, and no client's norm is in the clear
    secure, data = _run(
        project,
        connection,
        timeout=600,
        overrides={"strategy": "fedexp", "secure-aggregation": "secagg+"},
    )
    rounds = data["rounds"]
    assert all(r["replies"]["used"] == 3 for r in rounds)
    assert all(r["strategy"]["secagg-error-bound"] > 0 for r in rounds)
    assert rounds[0]["strategy"]["secagg-norm-bound"] == 0.0  # none in round 1
    assert rounds[1]["strategy"]["secagg-norm-bound"] > 0
    replies = (secure.results.parent / "clients.jsonl").read_text().splitlines()
    assert replies and all(
        "update-sq-norm" not in json.loads(line)["metrics"] for line in replies
    )

    # the CLI cannot talk to the TLS SuperLink without verifying its certificate
    write_connection(connection.flwr_home, "plain", connection.address)
    with pytest.raises(RuntimeError):
        flwr(["ls", "plain"], env, retries=0)
