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

from fedadapt.tools.submission import free_port
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
        f"num-server-rounds=2 clients-per-round=3 output-dir='{out}' run-name='e2e' "
        "fedavg.weighting='uniform'",  # a strategy's <strategy>.<param> key
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = out / "e2e" / "results.json"
    assert f"results: {results}" in done.stdout
    data = json.loads(results.read_text())
    assert data["status"] == "completed"
    assert data["config"]["num-server-rounds"] == 2
    assert data["config"]["fedavg.weighting"] == "uniform"
    assert data["config"]["feddua.epsilon-g"] == 0.0  # pyproject's dotted keys
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


# a Ray simulation of ~40 s: with make test-deploy (CI runs it), to keep
# the default suite within CI's 20 minutes; tests/tools/test_failed_cell.py
# fails a ServerApp in the default suite
@pytest.mark.deploy
def test_run_that_fails_in_the_serverapp_is_reported_as_failure(tmp_path):
    # 5 clients per round cannot be served by 3 simulated SuperNodes: the
    # ServerApp fails at start, not after node-wait-timeout; `flwr run`
    # itself would still exit 0.
    done = _simulate(
        tmp_path,
        f"clients-per-round=5 node-wait-timeout=3600 output-dir='{tmp_path / 'out'}'",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "finished:failed" in done.stdout
    assert "the simulated federation has 3 nodes" in done.stderr
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


@pytest.mark.deploy  # three `flwr run`s, ~65 s; the three-supernode run stays
def test_plain_flwr_run_with_flowers_defaults(tmp_path):
    """The README's plain `flwr run . local`: Flower's default federation
    (2 simulated nodes) and the app's defaults complete; then, on the same
    `:local:` SuperLink, a bad config and a missing dataset each end the run
    at once with one line that names the problem, and no traceback."""
    from tests.helpers import pids_under, stop_processes_under

    home, out = tmp_path / "flwr-home", tmp_path / "out"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n[superlink.local]\naddress = ":local:"\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
    }

    def flwr_run(run_config: str) -> str:
        done = subprocess.run(
            [str(VENV_BIN / "flwr"), "run", ".", "local", "--stream",
             "--run-config", f"output-dir='{out}' {run_config}"],
            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr  # flwr run's way
        return done.stdout + done.stderr

    def statuses() -> list[str]:
        listed = subprocess.run(
            [str(VENV_BIN / "flwr"), "ls", "local", "--format", "json"],
            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
        )  # fmt: skip
        runs = json.loads(listed.stdout)["runs"]
        return [r["status"] for r in sorted(runs, key=lambda r: r["pending-at"])]

    try:
        flwr_run("num-server-rounds=2 run-name='plain'")
        data = json.loads((out / "plain" / "results.json").read_text())
        assert data["status"] == "completed"
        assert [r["replies"]["used"] for r in data["rounds"]] == [2, 2]

        log = flwr_run("strategy='fedfoo'")
        assert "fedadapt: run failed: Invalid run-config 'strategy': unknown " in log
        assert "Traceback" not in log

        log = flwr_run(f"task='mnist-cnn' data-dir='{tmp_path / 'none'}' run-name='m'")
        assert log.count("Dataset 'mnist' not found under data-dir") == 1
        assert "Traceback" not in log
        assert not (out / "m").exists()  # no results.json left "running"

        assert statuses() == ["finished:completed"] + ["finished:failed"] * 2
    finally:
        assert pids_under(home), "the :local: SuperLink should have been running"
        stop_processes_under(home)
    assert_no_processes_under(home)
