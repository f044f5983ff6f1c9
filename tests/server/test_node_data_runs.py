"""Runs whose nodes hold their own data and whose server holds none (issue #31).

Central evaluation is optional: off (the server loads nothing), the task's
test set (the default, unchanged), or a server-side dataset of its own;
results.json says which one each round's ``eval`` is. A node whose
data-path is bad fails its replies with one line naming node and path; the
run goes on with the others and results.json counts the failure with it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedadapt.config import ConfigError
from fedadapt.server.results import evaluation_sources
from fedadapt.server.run import central_evaluator, server_validation_loss
from fedadapt.tasks import TASKS, Task

DIGITS = TASKS.get("digits-mlp")


def test_evaluation_sources_say_what_each_evaluation_is(cfg):
    assert evaluation_sources(cfg()) == {
        "central": {"source": "task-test-set", "every": 1},
        "federated": {"source": "off"},
    }
    assert evaluation_sources(cfg(evaluate_every=0, clients_per_eval=3)) == {
        "central": {"source": "off"},
        "federated": {"source": "node-held-out", "clients-per-eval": 3},
    }
    assert evaluation_sources(cfg(central_data_path="/srv/eval.npz"))["central"] == {
        "source": "central-data-path", "path": "/srv/eval.npz", "every": 1,
    }  # fmt: skip


def test_central_evaluation_off_loads_no_data(cfg):
    def no_data(_cfg):
        raise AssertionError("the server must not load a test set")

    task = Task("t", "t", DIGITS.build_model, DIGITS.load_client, no_data)
    assert central_evaluator(task, cfg(evaluate_every=0)) is None


def test_central_evaluation_on_a_server_side_dataset(tmp_path, cfg):
    rng = np.random.default_rng(0)
    x = rng.random((30, 64), dtype=np.float32)
    y = rng.integers(0, 10, 30)
    np.savez(tmp_path / "eval.npz", x=x, y=y)
    torch.manual_seed(0)
    model = DIGITS.build_model()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    scores = central_evaluator(
        DIGITS, cfg(central_data_path=str(tmp_path / "eval.npz"))
    )
    got = scores(state)
    # oracle: the same model's outputs on the saved arrays, scored here
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
    accuracy = (logits.argmax(1).numpy() == y).mean()
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["accuracy"] == pytest.approx(accuracy)
    assert got["num-examples"] == 30


def test_a_bad_central_data_path_names_the_key(tmp_path, cfg):
    with pytest.raises(ConfigError, match="central-data-path.*no such file"):
        central_evaluator(DIGITS, cfg(central_data_path=str(tmp_path / "absent.npz")))


def test_the_influence_screen_scores_a_seeded_sample_of_the_training_pool(cfg):
    # oracle: the same rows drawn here with the run's seed, scored by hand
    from fedadapt.tasks.digits import load_digits_split

    run = cfg(validation_size=50, seed=3)
    loss = server_validation_loss(DIGITS, run)
    pool = load_digits_split()[0].tensors
    rows = np.sort(np.random.default_rng(3).choice(len(pool[1]), 50, replace=False))
    torch.manual_seed(0)
    model = DIGITS.build_model()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(
            model(pool[0][rows]), pool[1][rows]
        ).item()
    assert loss(state) == pytest.approx(expected, rel=1e-5)


def test_the_influence_screen_reads_a_server_side_dataset(tmp_path, cfg):
    rng = np.random.default_rng(0)
    x = rng.random((30, 64), dtype=np.float32)
    y = rng.integers(0, 10, 30)
    np.savez(tmp_path / "val.npz", x=x, y=y)
    path = str(tmp_path / "val.npz")
    loss = server_validation_loss(
        DIGITS, cfg(validation_size=500, validation_data_path=path)
    )
    torch.manual_seed(0)
    model = DIGITS.build_model()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    with torch.no_grad():  # all 30 rows: fewer than validation-size
        expected = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x)), torch.from_numpy(y)
        ).item()
    assert loss(state) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ConfigError, match="validation-data-path.*no such file"):
        server_validation_loss(
            DIGITS, cfg(validation_size=5, validation_data_path=str(tmp_path / "no"))
        )


def test_the_influence_screen_asked_for_where_it_cannot_act_is_refused(cfg):
    # a user who sets validation-size gets the screen or a clear error,
    # never a run without the defence they asked for
    assert server_validation_loss(DIGITS, cfg()) is None  # validation-size 0
    for setting in ({"aggregation": "median"}, {"secure_aggregation": "secagg+"}):
        with pytest.raises(ConfigError, match="validation-size.*individual updates"):
            server_validation_loss(DIGITS, cfg(validation_size=9, **setting))
    poolless = Task("t", "t", DIGITS.build_model, DIGITS.load_client, DIGITS.load_test)
    with pytest.raises(ConfigError, match="set validation-data-path"):
        server_validation_loss(poolless, cfg(validation_size=9))


@pytest.mark.e2e
@pytest.mark.deploy  # ~22 s through Flower: make test-deploy, for the default suite
def test_server_without_data_and_a_node_with_a_corrupt_path(tmp_path, cfg):
    """Two good nodes (hf, npz), one corrupt; the server evaluates nothing itself."""
    from fedadapt.tasks.node_data import write_node_datasets
    from tests.helpers import run_in_process

    paths = write_node_datasets(
        DIGITS, cfg(partition="iid"), 3, tmp_path / "nodes", ["hf", "npz", "npz"]
    )
    paths[2].write_bytes(b"PK\x03\x04 not a zip")  # node 2's file is damaged

    def own_data(simulated):
        return {"data-path": str(paths[int(simulated["partition-id"])])}

    run_in_process(
        {
            "output-dir": str(tmp_path / "out"),
            "run-name": "own",
            "num-server-rounds": 2,
            "local-steps": 10,
            "evaluate-every": 0,
            "clients-per-eval": 3,
            "checkpoint-every": 0,
        },
        node_config=own_data,
    )
    data = json.loads((tmp_path / "out" / "own" / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["evaluation"]["central"] == {"source": "off"}
    assert data["evaluation"]["federated"]["source"] == "node-held-out"
    assert data["initial"] == {"eval": None}
    for entry in data["rounds"]:
        assert entry["eval"] is None
        for phase in ("replies", "evaluate_replies"):
            replies = entry[phase]
            assert (replies["used"], replies["failed"]) == (2, 1), replies
            (error,) = replies["errors"]
            assert f"data-path {paths[2]}: not a readable npz file" in error
            assert "node " in error.split("data-path")[0]
        assert entry["federated_eval"]["eval-loss"] > 0


def test_round_hook_with_central_evaluation_off_records_none(tmp_path, cfg):
    """Both ServerApps' per-round hook: no evaluation, no data, rounds recorded."""
    from unittest.mock import Mock

    from fedadapt.server.results import RunRecorder
    from fedadapt.server.run import RoundHook

    def no_data(_cfg):
        raise AssertionError("the server must not load a test set")

    task = Task("t", "t", DIGITS.build_model, DIGITS.load_client, no_data)
    config = cfg(evaluate_every=0, checkpoint_every=0, num_server_rounds=2)
    recorder = RunRecorder(tmp_path, config, run_id=1)
    hook = RoundHook(config, task, Mock(round_reports={}), recorder)
    assert hook(0, {}) is None and hook(1, {}) is None and hook(2, {}) is None
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["initial"] == {"eval": None}
    assert [r["eval"] for r in data["rounds"]] == [None, None]
    assert data["evaluation"]["central"] == {"source": "off"}
