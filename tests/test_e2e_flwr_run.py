"""Real ``flwr run`` against a real simulation SuperLink, as a user runs it.

``fedadapt simulate`` starts a loopback SuperLink in its own process group,
calls ``flwr run`` and polls ``flwr ls`` for the run's real status. Every test
checks afterwards that no process it started survives.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fedadapt.cli import free_port
from tests.helpers import ROOT, VENV_BIN, assert_no_processes_under

pytestmark = pytest.mark.e2e


def _simulate(tmp_path: Path, run_config: str, timeout: float = 300):
    flwr_home = tmp_path / "flwr-home"
    done = subprocess.run(
        [str(VENV_BIN / "fedadapt"), "simulate", "--app", str(ROOT),
         "--num-supernodes", "3", "--flwr-home", str(flwr_home), "--quiet",
         "--port", str(free_port()), "--run-config", run_config],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
        env={**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"},
    )  # fmt: skip
    assert_no_processes_under(flwr_home)
    return done


def test_flwr_run_three_supernodes_two_rounds(tmp_path):
    out = tmp_path / "out"
    done = _simulate(
        tmp_path,
        f"num-server-rounds=2 clients-per-round=3 output-dir='{out}' run-name='e2e'",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = out / "e2e" / "results.json"
    assert f"results: {results}" in done.stdout
    data = json.loads(results.read_text())
    assert data["status"] == "completed"
    assert data["config"]["num-server-rounds"] == 2
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    assert all(r["replies"]["used"] == 3 for r in data["rounds"])
    losses = [data["initial"]["eval"]["loss"]] + [
        r["eval"]["loss"] for r in data["rounds"]
    ]
    assert losses[2] < losses[1] < losses[0], losses
    assert (
        data["rounds"][1]["train"]["train-loss"]
        < data["rounds"][0]["train"]["train-loss"]
    )
    assert (out / "e2e" / "curves.png").exists()


def test_run_that_fails_in_the_serverapp_is_reported_as_failure(tmp_path):
    # 5 clients per round cannot be served by 3 SuperNodes: the ServerApp
    # raises at start; `flwr run` itself would still exit 0.
    done = _simulate(
        tmp_path,
        f"clients-per-round=5 node-wait-timeout=1 output-dir='{tmp_path / 'out'}'",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "finished:failed" in done.stdout
    assert not list((tmp_path / "out").glob("*/results.json"))


def test_invalid_config_fails_before_anything_starts(tmp_path):
    done = _simulate(tmp_path, "num-server-rounds=0", timeout=60)
    assert done.returncode == 2
    assert "Invalid run-config 'num-server-rounds': must be >= 1, got 0" in done.stderr
    assert not (tmp_path / "flwr-home").exists()  # no SuperLink was started


def test_unknown_key_fails_before_anything_starts(tmp_path):
    done = _simulate(tmp_path, "bogus-key=1", timeout=60)
    assert done.returncode == 2
    assert "Invalid run-config 'bogus-key': unknown key. Valid keys:" in done.stderr
