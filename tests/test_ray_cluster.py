"""The Ray simulation on an existing Ray cluster (issue #11, beyond one machine).

The test starts a real Ray head (`ray start --head`) on a loopback address,
runs `fedadapt simulate --ray-address` against it and checks that Flower's
ClientApp actors ran in *that* cluster (their logs are in its session
folder; a private Ray instance would log elsewhere), that the results have
the shape of a local run's, and that every process it started is gone.
Ray replaces 127.0.0.1 by the host's interface address, so the head uses
127.0.0.2 (still loopback).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fedadapt.deploy.process import free_port
from tests.helpers import ROOT, VENV_BIN, assert_no_processes_under

pytestmark = pytest.mark.e2e

RUN = (
    "num-server-rounds=2 clients-per-round=3 local-steps=5 "
    "output-dir='{out}' run-name='{name}'"
)


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@pytest.fixture
def ray_head():
    """A Ray head on 127.0.0.2 with its own (short) temp dir; stopped by PID."""
    temp = Path(tempfile.mkdtemp(prefix="fa-ray-", dir="/tmp"))  # socket path limit
    port = free_port()
    started = subprocess.run(
        [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.2",
         f"--port={port}", "--num-cpus=2", "--disable-usage-stats",
         "--include-dashboard=false", f"--temp-dir={temp}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"127.0.0.2:{port}", temp
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _processes_mentioning(str(temp)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 15
            while _processes_mentioning(str(temp)) and time.monotonic() < deadline:
                time.sleep(0.5)
        assert _processes_mentioning(str(temp)) == [], "Ray processes left running"


def _simulate(tmp_path, name, *extra):
    out = tmp_path / "out"
    home = tmp_path / f"home-{name}"
    done = subprocess.run(
        [str(VENV_BIN / "fedadapt"), "simulate", "--app", str(ROOT), "--quiet",
         "--num-supernodes", "3", "--flwr-home", str(home),
         "--run-config", RUN.format(out=out, name=name), *extra],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert_no_processes_under(home)
    return json.loads((out / name / "results.json").read_text())


def _shape(value):
    """Keys and types, recursively: what two runs of one config share."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k not in VARYING}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


VARYING = {"run_id", "started", "finished", "versions", "run_config", "output_dir"}


def test_simulation_runs_on_an_existing_ray_cluster(tmp_path, ray_head):
    address, temp = ray_head
    cluster = _simulate(tmp_path, "cluster", "--ray-address", address)
    logs = temp / "session_latest" / "logs"
    actor_logs = [
        p
        for p in logs.glob("worker-*")
        if "ClientAppActor" in p.read_text(errors="ignore")
    ]
    assert actor_logs, f"no ClientAppActor ran in the cluster at {address}"
    local = _simulate(tmp_path, "local")
    assert cluster["status"] == local["status"] == "completed"
    assert _shape(cluster) == _shape(local)
    assert [r["replies"]["used"] for r in cluster["rounds"]] == [3, 3]
