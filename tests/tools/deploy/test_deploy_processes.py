"""Real deployment as processes: SuperLink + SuperNodes on loopback (issue #11).

One TLS + SuperNode-authentication deployment of 3 SuperNodes serves three
checks in turn: a 2-round run of an adaptive strategy, a SuperNode with an
unregistered key being refused, and a run that loses a SuperNode (SIGKILL)
mid-run and still completes. Every process started is verified gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import (
    load_pem_private_key,
    load_ssh_private_key,
    load_ssh_public_key,
)

from fedadapt.tools.deploy.certs import (
    make_certificates,
    make_node_keys,
    public_key_path,
)
from fedadapt.tools.deploy.local import LocalDeployment
from fedadapt.tools.submission import submit_run
from tests.helpers import ROOT, assert_no_processes_under

RUN = {
    "task": "digits-mlp",
    "strategy": "feddua",
    "clients-per-round": 3,
    "local-steps": 5,
    "evaluate-every": 1,
}


# --- certificates and keys (no processes) ---------------------------------------


def test_server_certificate_verifies_against_the_ca_with_the_requested_names(
    tmp_path,
):
    files = make_certificates(tmp_path, ["superlink", "localhost", "127.0.0.1"])
    done = subprocess.run(
        ["openssl", "verify", "-CAfile", files["ca.crt"], files["server.crt"]],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cert = x509.load_pem_x509_certificate(files["server.crt"].read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["superlink", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    key = load_pem_private_key(files["server.key"].read_bytes(), None)
    assert key.public_key() == cert.public_key()
    for name in ("ca.key", "server.key"):
        assert files[name].stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError, match="--force"):
        make_certificates(tmp_path, ["localhost"])
    make_certificates(tmp_path, ["localhost"], force=True)


def test_node_keys_load_as_flower_loads_them(tmp_path):
    from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

    keys = make_node_keys(tmp_path, 2)
    assert [k.name for k in keys] == ["supernode-1.key", "supernode-2.key"]
    for key_path in keys:
        private = load_ssh_private_key(key_path.read_bytes(), None)
        public = load_ssh_public_key(public_key_path(key_path).read_bytes())
        assert private.public_key() == public and uses_nist_ec_curve(public)
        assert key_path.stat().st_mode & 0o777 == 0o600


def test_certs_command_refuses_to_overwrite(tmp_path, capsys):
    from fedadapt.tools.cli import main

    assert main(["certs", "--out", str(tmp_path), "--host", "localhost"]) == 0
    assert main(["certs", "--out", str(tmp_path), "--host", "localhost"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["node-keys", "--out", str(tmp_path), "--count", "1"]) == 0


def test_auth_without_tls_is_refused_before_starting(tmp_path):
    with pytest.raises(ValueError, match="needs TLS"):
        LocalDeployment(tmp_path, 3, auth=True)


# --- the real deployment ------------------------------------------------------------


def _results(path: Path | None) -> dict:
    assert path is not None, "no results.json"
    return json.loads(path.read_text())


def _kill_when_training_starts(deployment, index, results_dir, timeout=120):
    """SIGKILL SuperNode ``index`` once the run has written its initial record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in results_dir.glob("*/results.json"):
            try:
                if json.loads(path.read_text()).get("initial") is not None:
                    os.killpg(deployment.supernodes[index].pid, signal.SIGKILL)
                    return
            except (OSError, json.JSONDecodeError):
                pass
        time.sleep(0.2)
    raise TimeoutError("the run never started")


@pytest.mark.e2e
@pytest.mark.deploy
def test_tls_auth_deployment_runs_refuses_strangers_and_survives_node_loss(tmp_path):
    workdir = tmp_path / "deploy"
    with LocalDeployment(workdir, 3, tls=True, auth=True) as deployment:
        assert len(deployment.online_nodes()) == 3

        # 1. two rounds of FedDuA on 3 SuperNodes over TLS with node auth
        out = tmp_path / "run1"
        outcome = submit_run(
            deployment,
            ROOT,
            {**RUN, "num-server-rounds": 2, "output-dir": str(out)},
            3,
            timeout=300,
        )
        assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
        data = _results(outcome.results)
        assert data["status"] == "completed" and len(data["rounds"]) == 2
        assert all(r["replies"]["used"] == 3 for r in data["rounds"])
        assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]

        # 2. a SuperNode whose key was never registered is refused
        stranger_key = make_node_keys(tmp_path / "stranger", 1)[0]
        stranger = deployment.supernode(3, private_key=stranger_key).start()
        try:
            code = stranger.process.wait(timeout=60)
        finally:
            stranger.stop()
        assert code != 0
        assert len(deployment.online_nodes()) == 3
        log = (workdir / "supernode-3" / "supernode.log").read_text()
        assert "Failed to activate SuperNode" in log, log[-2000:]

        # 3. a SuperNode killed in round 1: the run completes with the others
        online = {str(n) for n in deployment.online_nodes()}
        out = tmp_path / "run2"
        killer = _start_thread(_kill_when_training_starts, deployment, 2, out)
        outcome = submit_run(
            deployment,
            ROOT,
            {**RUN, "num-server-rounds": 2, "output-dir": str(out)},
            3,
            timeout=400,
        )
        killer.join(timeout=5)
        assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
        data = _results(outcome.results)
        rounds = data["rounds"]
        assert data["status"] == "completed" and len(rounds) == 2
        assert sum(r["replies"]["failed"] for r in rounds) >= 1  # the lost reply
        # results.json names the lost node (not the SuperLink that answered
        # for it) and the reason, once per failed reply
        lost = online - {str(n) for n in deployment.online_nodes()}
        errors = [e for r in rounds for e in r["replies"]["errors"]]
        assert len(errors) == sum(r["replies"]["failed"] for r in rounds)
        assert {e.split(":")[0] for e in errors} == {f"node {n}" for n in lost}
        assert rounds[-1]["replies"]["used"] == 2
        assert rounds[-1]["nodes"]["train"] == {"wanted": 3, "connected": 2}
        assert rounds[-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
    assert_no_processes_under(workdir)


def _start_thread(target, *args):
    import threading

    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


@pytest.mark.e2e
@pytest.mark.deploy
def test_deployment_reuses_one_warm_worker_per_node_and_leaves_none(
    tmp_path, monkeypatch
):
    """Issue #40: each node's messages go to one worker, started once.

    Flower starts a new flwr-clientapp process per message; with
    client-worker=auto each hands its message to the node's worker, which
    must serve every round (one start per node in its log), and end with
    the deployment (none left, checked by pid and by FLWR_HOME).
    """
    import re
    import tempfile

    from fedadapt.client import worker

    # a short folder of our own for the workers' sockets (Unix socket paths
    # are limited to ~107 characters) and logs
    short = Path(tempfile.mkdtemp(prefix="fw", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(short))
    workdir = tmp_path / "deploy"
    try:
        with LocalDeployment(workdir, 2) as deployment:
            out = tmp_path / "run"
            config = {**RUN, "clients-per-round": 2, "num-server-rounds": 3,
                      "output-dir": str(out)}  # fmt: skip
            outcome = submit_run(deployment, ROOT, config, 2, timeout=400)
            assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
            data = _results(outcome.results)
            assert data["status"] == "completed"
            assert [r["replies"]["used"] for r in data["rounds"]] == [2, 2, 2]
            logs = sorted(short.glob("fedadapt-workers-*/*.log"))
            starts = [re.findall(r"worker (\d+): listening", p.read_text())
                      for p in logs]  # fmt: skip
            assert len(logs) == 2 and all(len(s) == 1 for s in starts), starts
            pids = [int(s[0]) for s in starts]
            assert all(worker.alive(pid, None) for pid in pids)
            # every reply still names the per-message process's own age
            lines = outcome.results.with_name("clients.jsonl").read_text()
            records = [json.loads(line) for line in lines.splitlines()]
            assert all(r["process_age_s"] > 0 for r in records)
        assert_no_processes_under(workdir)
        assert not any(worker.alive(pid, None) for pid in pids)
    finally:
        import shutil

        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.deploy
def test_secagg_deployment_over_tls_with_node_auth(tmp_path):
    """Issue #41 item 5: real SecAgg+ between processes, TLS and node keys.

    The default apps, secure-aggregation = "secagg+": two rounds of FedExP on
    3 SuperNodes, each round the four SecAgg+ exchanges (round 1 calibrates
    the norm bound, round 2 sends the rotated block); the server steps on
    the revealed sums (the error bound recorded per round), clients.jsonl
    holds no norm of any client, and nothing is left running.
    """
    workdir = tmp_path / "deploy"
    with LocalDeployment(workdir, 3, tls=True, auth=True) as deployment:
        out = tmp_path / "secure"
        config = {**RUN, "strategy": "fedexp", "num-server-rounds": 2,
                  "local-steps": 3, "secure-aggregation": "secagg+",
                  "output-dir": str(out)}  # fmt: skip
        outcome = submit_run(deployment, ROOT, config, 3, timeout=600)
        assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
        data = _results(outcome.results)
        assert data["status"] == "completed"
        assert [r["replies"]["used"] for r in data["rounds"]] == [3, 3]
        assert all(r["strategy"]["secagg-error-bound"] > 0 for r in data["rounds"])
        # round 1 measures the clients' norms (no bound yet), round 2 steps
        assert data["rounds"][0]["strategy"]["secagg-calibration"] == 1.0
        assert data["rounds"][1]["strategy"]["secagg-norm-bound"] > 0
        assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
        lines = outcome.results.with_name("clients.jsonl").read_text().splitlines()
        assert len(lines) == 6  # 3 replies a round
        for record in map(json.loads, lines):
            assert record["server_sq_norm"] is None
            assert record["reported_sq_norm"] is None
    assert_no_processes_under(workdir)
