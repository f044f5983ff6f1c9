"""Deployment where each node owns its data and the server holds none (issue #31).

Three SuperNodes as real processes, each with its own on-disk dataset in a
different format (Hugging Face save_to_disk, npz, image folder; written by
``fedadapt make-node-data``), and a fourth whose data does not fit the task
(wrong input shape). The ServerApp evaluates nothing itself
(``evaluate-every=0``): results.json reports the federated evaluation on
each node's held-out split, which must beat chance and improve, and counts
the misfit node's replies as failed with its node and path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedadapt.config import validate_run_config
from fedadapt.tasks import TASKS
from fedadapt.tasks.node_data import write_node_datasets
from fedadapt.tools.deploy.local import LocalDeployment
from fedadapt.tools.submission import submit_run
from tests.helpers import ROOT, assert_no_processes_under

RUN = {
    "task": "digits-mlp",
    "strategy": "fedavg",
    "num-server-rounds": 3,
    "local-steps": 20,
    "client-lr": 0.1,
    "evaluate-every": 0,  # the server holds no data
    "clients-per-eval": 4,
    "checkpoint-every": 0,
}


def test_local_deployment_wants_one_data_path_per_node(tmp_path):
    with pytest.raises(ValueError, match="2 data paths for 3 SuperNodes"):
        LocalDeployment(tmp_path, 3, data_paths=[tmp_path, tmp_path])
    node = LocalDeployment(tmp_path, 1, data_paths=[tmp_path / "my data"]).supernode(0)
    assert f'--node-config=data-path="{tmp_path}/my data"' in node.command


@pytest.mark.e2e
@pytest.mark.deploy
def test_three_nodes_with_their_own_data_and_a_server_without(tmp_path):
    cfg = validate_run_config({"task": "digits-mlp", "partition": "iid"})
    paths = write_node_datasets(
        TASKS.get("digits-mlp"), cfg, 3, tmp_path / "nodes",
        ["hf", "npz", "imagefolder"],
    )  # fmt: skip
    misfit = tmp_path / "misfit.npz"  # 8×8 digits cut to 60 inputs
    np.savez(misfit, x=np.zeros((20, 60), np.float32), y=np.arange(20) % 10)
    workdir = tmp_path / "deploy"
    with LocalDeployment(workdir, 4, data_paths=[*paths, misfit]) as deployment:
        outcome = submit_run(
            deployment, ROOT, {**RUN, "output-dir": str(tmp_path / "out")}, 4,
            timeout=600,
        )  # fmt: skip
    assert_no_processes_under(workdir)
    assert outcome.results is not None, (outcome.status, outcome.details)
    data = json.loads(outcome.results.read_text())
    assert data["status"] == "completed", data.get("error")
    assert data["evaluation"]["central"] == {"source": "off"}
    rounds = data["rounds"]
    assert len(rounds) == 3 and all(r["eval"] is None for r in rounds)
    for entry in rounds:
        for phase in ("replies", "evaluate_replies"):
            assert (entry[phase]["used"], entry[phase]["failed"]) == (3, 1)
            (error,) = entry[phase]["errors"]
            assert f"data-path {misfit}: x/y inputs has samples of shape (60,)" in (
                error
            )
    accuracy = [r["federated_eval"]["eval-accuracy"] for r in rounds]
    loss = [r["federated_eval"]["eval-loss"] for r in rounds]
    print("federated eval accuracy", accuracy, "loss", loss)
    assert accuracy[-1] > 0.5  # chance: 0.1
    assert loss[-1] < loss[0]
