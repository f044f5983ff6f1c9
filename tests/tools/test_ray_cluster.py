"""The Ray simulation on an existing Ray cluster (issue #11, beyond one machine).

The test starts a real Ray head (``ray start --head``) on a loopback address,
runs ``fedadapt simulate --ray-address`` against it and checks that Flower's
simulation runtime really joined *that* cluster: its driver and the
ClientApp actors log into the cluster's own session folder (a private Ray
instance would log under /tmp/ray or $RAY_TMPDIR instead). The results must
have the shape of a local run of the same config (run at the same time, to
keep the test short) and the same numbers.

Ray rewrites 127.0.0.1 (and ``localhost``) to the host's interface address,
so the head uses 127.0.0.2, which is still loopback. ``ray stop`` would stop
every Ray process on the machine (other users' simulations included), so the
head is started in its own session and exactly that session is stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedadapt.tools.deploy.process import free_port
from tests.helpers import ROOT, VENV_BIN, assert_no_processes_under

pytestmark = pytest.mark.e2e

HOST = "127.0.0.2"
RUN = (
    "num-server-rounds=2 clients-per-round=3 local-steps=5 "
    "output-dir='{out}' run-name='{name}'"
)


def session_members(sid: int) -> list[int]:
    """PIDs of the live processes in session ``sid``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        # fields after "pid (comm)": state ppid pgrp session ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(proc.name))
    return found


def stop_session(sid: int, grace: float = 5.0) -> list[int]:
    """SIGTERM every process of session ``sid``, SIGKILL what lingers.

    Returns
    -------
    list of int
        PIDs still alive afterwards (empty when everything stopped).
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in session_members(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while session_members(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return session_members(sid)


@pytest.fixture
def ray_head() -> Iterator[tuple[str, Path]]:
    """A one-node Ray cluster on 127.0.0.2 with its own temp dir.

    ``ray start`` runs as the leader of a new session; every Ray daemon it
    leaves behind (GCS, raylet, agents, client server, workers) stays in that
    session, so the teardown stops exactly those processes.
    """
    # short path: Ray's Unix sockets live under the temp dir (108-byte limit)
    temp = Path(tempfile.mkdtemp(prefix="fa-ray-", dir="/tmp"))
    port = free_port()
    start = subprocess.Popen(
        [
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            f"--node-ip-address={HOST}",
            f"--port={port}",
            f"--ray-client-server-port={free_port()}",
            "--num-cpus=2",
            "--disable-usage-stats",
            "--include-dashboard=false",
            f"--temp-dir={temp}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = start.communicate(timeout=120)
        assert start.returncode == 0, output
        yield f"{HOST}:{port}", temp / "session_latest" / "logs"
    finally:
        start.kill()  # no-op unless `ray start` itself hung
        left = stop_session(start.pid)
        shutil.rmtree(temp, ignore_errors=True)
        assert left == [], f"Ray processes left running: {left}"


def _simulate(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    """Start ``fedadapt simulate`` (3 SuperNodes); its output goes to <name>.log."""
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen(
            [
                str(VENV_BIN / "fedadapt"),
                "simulate",
                "--app",
                str(ROOT),
                "--quiet",
                "--num-supernodes",
                "3",
                "--flwr-home",
                str(tmp_path / f"home-{name}"),
                "--run-config",
                RUN.format(out=tmp_path / "out", name=name),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop a CLI still running: SIGTERM first, so that it stops its daemons."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _finish(proc: subprocess.Popen[str], tmp_path: Path, name: str) -> dict:
    try:
        proc.wait(timeout=300)
    finally:
        _stop(proc)
    assert proc.returncode == 0, (tmp_path / f"{name}.log").read_text()
    assert_no_processes_under(tmp_path / f"home-{name}")
    return json.loads((tmp_path / "out" / name / "results.json").read_text())


def _shape(value: Any) -> Any:
    """Keys and value types, recursively: what two runs of one config share.

    Node ids differ between runs: a mapping keyed by them (results.json's
    per-node ``communication``) becomes the list of its values' shapes.
    """
    if isinstance(value, dict):
        if value and all(str(k).isdigit() for k in value):
            return {"<node ids>": [_shape(v) for v in value.values()]}
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def _logs_naming(logs: Path, pattern: str, text: str) -> list[Path]:
    return [p for p in logs.glob(pattern) if text in p.read_text(errors="ignore")]


@pytest.fixture
def local_run(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The same run on a private Ray, started first to overlap the head's start."""
    proc = _simulate(tmp_path, "local")
    try:
        yield proc
    finally:
        _stop(proc)


# local_run before ray_head: fixtures are set up in this order
# a deployment of its own (a Ray head started here): with make test-deploy,
# which CI runs, to keep the default suite within CI's time
@pytest.mark.deploy
def test_simulation_runs_on_an_existing_ray_cluster(tmp_path, local_run, ray_head):
    address, logs = ray_head
    cluster = _finish(
        _simulate(tmp_path, "cluster", "--ray-address", address), tmp_path, "cluster"
    )
    local = _finish(local_run, tmp_path, "local")
    # The cluster run's simulation runtime connected as the cluster's driver,
    # ClientApp actors were workers of that cluster; the local run, which has
    # no --ray-address, did not join it.
    drivers = list(logs.glob("python-core-driver-*.log"))
    assert len(drivers) == 1, f"expected one driver in {logs}: {drivers}"
    assert _logs_naming(logs, "worker-*.out", "ClientAppActor"), (
        f"no ClientAppActor ran in the cluster at {address}"
    )
    assert cluster["status"] == local["status"] == "completed"
    assert _shape(cluster) == _shape(local)
    assert [r["round"] for r in cluster["rounds"]] == [1, 2]
    assert [r["replies"]["used"] for r in cluster["rounds"]] == [3, 3]
    # same seed, same config: the cluster computed the same model
    for ours, theirs in zip(cluster["rounds"], local["rounds"], strict=True):
        assert ours["eval"]["loss"] == pytest.approx(theirs["eval"]["loss"], 1e-5)


SECOND_HOST = "127.0.0.3"


@pytest.fixture
def two_node_cluster(tmp_path: Path) -> Iterator[str]:
    """A head (127.0.0.2) and a second Ray node (127.0.0.3), one CPU each.

    The head is fedadapt's own :class:`PrivateRayCluster`; the second node
    joins it with ``ray start --address`` under the same process-tree mark,
    so leaving the fixture stops both nodes and nothing else.
    """
    from fedadapt.tools.deploy.process import flower_env, venv_bin
    from fedadapt.tools.deploy.ray_cluster import PrivateRayCluster

    with PrivateRayCluster(tmp_path / "ray-logs", num_cpus=1) as head:
        env = head.tree.env(flower_env(tmp_path / "ray-logs"))
        joined = subprocess.run(
            [
                str(venv_bin() / "ray"),
                "start",
                f"--address={head.address}",
                f"--node-ip-address={SECOND_HOST}",
                "--num-cpus=1",
                f"--dashboard-agent-listen-port={free_port()}",
                "--disable-usage-stats",
            ],
            env=env,
            capture_output=True,
            text=True,
            start_new_session=True,
            timeout=180,
        )
        assert joined.returncode == 0, joined.stdout + joined.stderr
        yield head.address
    assert head.tree.pids() == {}


def _ray_node_ids(address: str) -> dict[str, str]:
    """Node IP -> the node id's first 12 hex digits, as Ray lists them."""
    code = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR'); "
        "print(json.dumps({n['NodeManagerAddress']: n['NodeID'][:12] "
        "for n in ray.nodes() if n['Alive']}))"
    )
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.deploy
def test_clients_on_two_ray_nodes_compute_the_single_node_model_bit_for_bit(
    tmp_path, two_node_cluster
):
    """Issue #39: a simulation whose clients run on two Ray nodes (one CPU
    each, so Flower's pool has one actor on each) gives the model of the same
    run on one machine's private Ray, bit for bit; clients.jsonl says which
    node each client ran on."""
    import numpy as np

    one_cpu = ("--federation-config", "client-resources-num-cpus=1")
    cluster = _simulate(
        tmp_path, "two-nodes", "--ray-address", two_node_cluster, *one_cpu
    )
    single = _simulate(tmp_path, "single", *one_cpu)
    assert _finish(cluster, tmp_path, "two-nodes")["status"] == "completed"
    assert _finish(single, tmp_path, "single")["status"] == "completed"

    nodes = _ray_node_ids(two_node_cluster)
    assert set(nodes) == {HOST, SECOND_HOST}, nodes
    lines = [
        json.loads(line)
        for line in (tmp_path / "out" / "two-nodes" / "clients.jsonl").open()
    ]
    used = {line["ray_node"] for line in lines}
    print(
        "clients per Ray node:",
        {
            ip: [
                (line["round"], line["partition"])
                for line in lines
                if line["ray_node"] == nid
            ]
            for ip, nid in nodes.items()
        },
    )
    assert used == set(nodes.values()), (used, nodes)

    ours = np.load(tmp_path / "out" / "two-nodes" / "final_model.npz")
    theirs = np.load(tmp_path / "out" / "single" / "final_model.npz")
    assert sorted(ours.files) == sorted(theirs.files)
    for key in ours.files:
        assert np.array_equal(ours[key], theirs[key]), key
