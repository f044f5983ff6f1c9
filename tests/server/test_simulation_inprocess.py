"""The apps end to end in flwr's in-process run_simulation (Ray backend)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import run_in_process, run_legacy_in_process

pytestmark = pytest.mark.e2e


def test_three_clients_three_rounds_learn(tmp_path):
    """Also federated evaluation folded into the train exchange (#40, the
    deployment default) through Flower's own messages: each round's replies
    carry the scores of the model they received (``model-round``, the
    previous round's), and one evaluate exchange of ``clients-per-eval``
    nodes scores the final model."""
    run_in_process(
        {
            "output-dir": str(tmp_path),
            "run-name": "inproc",
            "num-server-rounds": 3,
            "clients-per-round": 3,
            "clients-per-eval": 2,
            "federated-eval-exchange": "with-train",
        }
    )
    data = json.loads((tmp_path / "inproc" / "results.json").read_text())
    assert data["status"] == "completed"
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        # an honest reply may be clipped: the pull cap (2x the median weight
        # × norm of three) can reach the client with the most data
        assert r["replies"]["clipped"] <= 1
        assert {k: v for k, v in r["replies"].items() if k != "clipped"} == {
            "received": 3, "failed": 0, "rejected": 0, "used": 3, "rejections": [],
            "norm_mismatches": 0, "errors": [],
        }  # fmt: skip
        assert r["evaluate_replies"]["used"] == 3  # the training clients
        assert r["federated_eval"]["eval-loss"] > 0
        assert "eval-loss" not in r["train"]  # kept out of the train average
    assert data["evaluation"]["federated"]["exchange"] == "with-train"
    assert [r["federated_eval"]["model-round"] for r in rounds] == [0, 1, 2]
    final = data["final_federated_eval"]
    assert final["model-round"] == 3 and data["final_evaluate_replies"]["used"] == 2
    assert final["eval-loss"] < rounds[0]["federated_eval"]["eval-loss"]
    test_losses = [data["initial"]["eval"]["loss"]] + [
        r["eval"]["loss"] for r in rounds
    ]
    assert test_losses == sorted(test_losses, reverse=True), test_losses
    assert rounds[-1]["train"]["train-loss"] < rounds[0]["train"]["train-loss"]
    assert (tmp_path / "inproc" / "curves.png").stat().st_size > 5000
    # the ServerApp's start-up, step by step (#39: which part of a cell's
    # start-up is ours); here the "process" is pytest's own, so only > 0
    startup = data["startup"]
    assert list(startup) == [
        "process_to_main", "config", "central_data", "nodes", "strategy",
        "partition_query", "initial_model", "recorder", "initial_evaluation",
    ]  # fmt: skip
    assert all(isinstance(v, float) and v >= 0 for v in startup.values()), startup
    assert startup["process_to_main"] > 0


@pytest.mark.parametrize(
    # one of each family in the default suite; the variants of the same code
    # path (FedOpt's other two, FedExP with momentum, FedAvgM) with make
    # test-deploy, which CI runs (CI's 20 minutes for the default suite)
    "strategy",
    [
        "fedadam",
        "fedexp",
        "feddua",
        *(
            pytest.param(s, marks=pytest.mark.deploy)
            for s in ("fedavgm", "fedadagrad", "fedyogi", "fedexpm")
        ),
    ],
)
def test_each_strategy_runs_through_flower(tmp_path, strategy):
    """Issue #4: a simulation run with each strategy; diagnostics reach results.json.

    Issue #27: final_model.npz scores exactly the last round's central
    evaluation in results.json; checkpoint.pkl keeps the iterate w_{t+1}
    training continues from, which with average-last-two is another model.
    """
    import pickle

    from fedadapt.server.run import central_evaluator
    from fedadapt.tasks import TASKS

    overrides = {"feddua.variant": "adagrad"} if strategy == "feddua" else {}
    run_in_process(
        {
            "output-dir": str(tmp_path),
            "run-name": strategy,
            "strategy": strategy,
            "num-server-rounds": 2,
            "clients-per-round": 3,
            "checkpoint-every": 2,
            **overrides,
        }
    )
    data = json.loads((tmp_path / strategy / "results.json").read_text())
    assert data["status"] == "completed"
    for r in data["rounds"]:
        assert r["replies"]["used"] == 3
        diag = r["strategy"]
        assert diag["server-lr"] > 0
        assert diag["mean-update-sq-norm"] > 0
        assert diag["norms-trusted"] == 0.0  # the server's own norms
        assert r["replies"]["norm_mismatches"] == 0  # honest clients agree
        if strategy in ("fedexp", "fedexpm", "feddua"):
            assert diag["mean-client-sq-norm"] >= diag["mean-update-sq-norm"]
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
    with np.load(tmp_path / strategy / "final_model.npz") as saved:
        final = dict(saved)
    cfg = data["config"]
    evaluate = central_evaluator(TASKS.get(cfg["task"]), cfg)
    assert evaluate(final) == data["rounds"][-1]["eval"]
    checkpoint = pickle.loads((tmp_path / strategy / "checkpoint.pkl").read_bytes())
    averaged = strategy in ("fedexp", "fedexpm", "feddua")  # average-last-two
    assert list(checkpoint["arrays"]) == list(final)
    same = all(np.array_equal(checkpoint["arrays"][k], v) for k, v in final.items())
    assert same is not averaged


def test_killed_run_resumed_with_resume_ends_with_exactly_the_same_model(
    tmp_path, monkeypatch
):
    """Issues #4, #26: a run killed after round 2, resumed in its own folder
    (``fedadapt simulate --resume``'s run config), == 4 rounds uninterrupted.

    The killed run is the folder of the uninterrupted one as it stood right
    after round 2's checkpoint (results.json still ``running``): what kill -9
    leaves. Checkpoints are written every round by default.
    """
    import pickle
    import shutil

    from fedadapt.server.run import RoundHook
    from fedadapt.tools.cli import resume_overrides

    checkpoint = RoundHook.checkpoint

    def snapshot_after_round_2(hook, server_round):
        checkpoint(hook, server_round)
        if server_round == 2 and hook.recorder.run_dir.name == "straight":
            shutil.copytree(hook.recorder.run_dir, tmp_path / "killed")

    monkeypatch.setattr(RoundHook, "checkpoint", snapshot_after_round_2)
    common = {"output-dir": str(tmp_path), "strategy": "feddua", "clients-per-round": 3}
    run_in_process({**common, "run-name": "straight", "num-server-rounds": 4})
    killed = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert killed["status"] == "running" and len(killed["rounds"]) == 2
    # issue #32: killed after round 3's clients.jsonl lines, mid-line of more
    straight_lines = (tmp_path / "straight" / "clients.jsonl").read_text()
    round_3 = [line for line in straight_lines.splitlines() if '"round": 3' in line]
    with open(tmp_path / "killed" / "clients.jsonl", "a") as f:
        f.write("\n".join(round_3) + "\n" + round_3[0][:25])
    run_in_process(resume_overrides(tmp_path / "killed", {}))

    def load(name):
        return pickle.loads((tmp_path / name / "checkpoint.pkl").read_bytes())

    resumed, straight = load("killed"), load("straight")
    assert resumed["round"] == straight["round"] == 4
    for key, value in straight["arrays"].items():
        np.testing.assert_array_equal(resumed["arrays"][key], value)
    for key, value in straight["strategy"]["rule"]["s"].items():
        np.testing.assert_array_equal(resumed["strategy"]["rule"]["s"][key], value)
    data = json.loads((tmp_path / "killed" / "results.json").read_text())
    reference = json.loads((tmp_path / "straight" / "results.json").read_text())
    assert data["status"] == "completed" and data["resumed_from_round"] == 2
    assert [r["round"] for r in data["rounds"]] == [1, 2, 3, 4]
    for got, want in zip(data["rounds"], reference["rounds"], strict=True):
        assert (got["train"], got["eval"]) == (want["train"], want["eval"])
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == [
        ".lock", "checkpoint.pkl", "clients.jsonl", "clients.png", "curves.png",
        "final_model.npz", "results.json",
    ]  # fmt: skip
    # per-client records: each round once, the same replies as uninterrupted
    from fedadapt.server.results import load_client_records

    def replies(name):
        return sorted(
            (r["round"], r["partition"], r["status"], r["server_sq_norm"])
            for r in load_client_records(tmp_path / name)
        )

    assert replies("killed") == replies("straight")
    assert [r[0] for r in replies("killed")] == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    final = np.load(tmp_path / "killed" / "final_model.npz")
    for key, value in np.load(tmp_path / "straight" / "final_model.npz").items():
        np.testing.assert_array_equal(final[key], value)


_OPTIMIZERS = [
    ("sgd", "fedavg", 0.1),
    ("delta-sgd", "fedavg", 0.2),
    ("delta-sgd-consecutive", "fedavg", 0.2),
    ("adam", "fedavg", 0.01),
    ("sps", "fedavg", 1.0),
    ("fed-lamb", "fed-lamb", 0.01),
    ("fed-ams", "fed-lamb", 0.01),
]
#: the NumPyClient path of the optimizers it has code of its own for (plain
#: SGD; Fed-LAMB's moment exchange) in the default suite; the others, whose
#: client code is the Message API's, with make test-deploy (CI's time budget)
_LEGACY_DEFAULT = {"sgd", "fed-lamb"}
#: through the Message API in the default suite: the adaptive client optimizers
#: of the papers; Adam, SPS and consecutive-batch Δ-SGD (torch's or unit-tested
#: steps on the same client path) with make test-deploy
_MESSAGE_DEFAULT = {"sgd", "delta-sgd", "fed-lamb", "fed-ams"}


@pytest.mark.parametrize(
    ("optimizer", "strategy", "lr", "api"),
    [
        pytest.param(
            *o,
            "message",
            marks=() if o[0] in _MESSAGE_DEFAULT else pytest.mark.deploy,
        )
        for o in _OPTIMIZERS
    ]
    + [
        pytest.param(
            *o,
            "legacy",
            marks=() if o[0] in _LEGACY_DEFAULT else pytest.mark.deploy,
        )
        for o in _OPTIMIZERS
    ],
)
def test_each_client_optimizer_improves_the_loss(
    tmp_path, optimizer, strategy, lr, api
):
    """Issue #5: a simulation run with each optimizer, Message API and NumPyClient."""
    if api == "message" and optimizer == "sgd":
        pytest.skip("covered by test_three_clients_three_rounds_learn")
    run = run_in_process if api == "message" else run_legacy_in_process
    run(
        {
            "output-dir": str(tmp_path),
            "run-name": optimizer,
            "strategy": strategy,
            "client-optimizer": optimizer,
            "client-lr": lr,
            "num-server-rounds": 2,
            "clients-per-round": 3,
        }
    )
    data = json.loads((tmp_path / optimizer / "results.json").read_text())
    assert data["status"] == "completed"
    assert all(r["replies"]["used"] == 3 for r in data["rounds"])
    from fedadapt.server.results import load_client_records

    records = load_client_records(tmp_path / optimizer)  # both APIs (issue #32)
    assert sorted((r["round"], r["partition"]) for r in records) == [
        (t, p) for t in (1, 2) for p in range(3)
    ]
    assert all(r["server_sq_norm"] > 0 and r["status"] == "used" for r in records)
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
    if optimizer.startswith("delta-sgd") or optimizer == "sps":
        train = data["rounds"][-1]["train"]
        assert 0 < train["opt-eta-min"] <= train["opt-eta-mean"] <= train["opt-eta-max"]
    if strategy == "fed-lamb":
        assert data["rounds"][-1]["strategy"]["v-hat-mean"] > 0
    # the traffic, the same in both APIs: the MLP's .npy bytes (4 per float32
    # value + 128 per array) each way; Fed-LAMB's v̂ / v double it (v̂ from
    # round 2 on)
    model = 4 * (64 * 64 + 64 + 64 * 10 + 10) + 4 * 128
    moments = model if strategy == "fed-lamb" else 0
    for r in data["rounds"]:
        comm = r["communication"]
        assert len(comm["sent"]) == len(comm["received"]) == 3
        for node, sent in comm["sent"].items():
            assert sent["arrays"] == model + (moments if r["round"] > 1 else 0)
            assert comm["received"][node]["arrays"] == model + moments


@pytest.mark.deploy  # ~22 s through Flower: make test-deploy, for the default suite
def test_legacy_run_that_stops_early_is_marked_failed(tmp_path, monkeypatch):
    """A legacy run whose loop raises in round 2 ends ``failed``, not ``running``,
    with the error that ended it (as the Message-API ServerApp records it)."""
    from fedadapt.server import legacy_app

    class BreaksInRoundTwo(legacy_app.RoundHook):
        def __call__(self, server_round, state):
            if server_round == 2:
                raise RuntimeError("injected failure")
            return super().__call__(server_round, state)

    monkeypatch.setattr(legacy_app, "RoundHook", BreaksInRoundTwo)
    try:
        run_legacy_in_process(
            {"output-dir": str(tmp_path), "run-name": "broken",
             "num-server-rounds": 3, "clients-per-round": 3}
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - whether run_simulation re-raises is Flower's
        pass
    data = json.loads((tmp_path / "broken" / "results.json").read_text())
    assert data["status"] == "failed"
    assert "injected failure" in data["error"]
    assert [r["round"] for r in data["rounds"]] == [1]


def test_stop_rule_ends_the_run_and_results_json_says_why(tmp_path):
    """Issue #27 part 6: any accuracy >= 0.01 ends a 3-round run after round 1.

    (The legacy app: tests/strategies/test_run_control.py, without Ray.)
    """
    run_in_process({"output-dir": str(tmp_path), "run-name": "stop",
                    "strategy": "fedexp", "num-server-rounds": 3,
                    "clients-per-round": 2, "stop-metric": "accuracy",
                    "stop-target": 0.01}, num_supernodes=2)  # fmt: skip
    data = json.loads((tmp_path / "stop" / "results.json").read_text())
    assert data["status"] == "completed"
    assert [r["round"] for r in data["rounds"]] == [1]
    assert data["stop_reason"] == "stop-target"
    accuracy = data["rounds"][0]["eval"]["accuracy"]
    assert data["stop_detail"].startswith(f"accuracy = {accuracy:.6g} reached")


@pytest.mark.parametrize(
    "api", ["message", pytest.param("legacy", marks=pytest.mark.deploy)]
)
def test_the_influence_screen_runs_in_the_app(tmp_path, api):
    """Issue #38: ``validation-size`` turns the screen on in either ServerApp;
    each used reply's clients.jsonl line has its influence, and a screened
    honest run learns (three clients: at most one may be rejected a round)."""
    run = run_in_process if api == "message" else run_legacy_in_process
    run(
        {
            "output-dir": str(tmp_path),
            "run-name": api,
            "num-server-rounds": 2,
            "clients-per-round": 3,
            "validation-size": 100,
        }
    )
    data = json.loads((tmp_path / api / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["config"]["validation-size"] == 100
    lines = [
        json.loads(line)
        for line in (tmp_path / api / "clients.jsonl").read_text().splitlines()
    ]
    assert len(lines) == 6
    assert all(isinstance(line["influence"], float) for line in lines), lines
    rejected = [line for line in lines if line["status"] == "rejected"]
    tolerance = data["config"]["influence-tolerance"]
    assert all(line["influence"] > tolerance for line in rejected)
    assert all(r["replies"]["rejected"] <= 1 for r in data["rounds"])
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]


def test_the_apps_default_aggregator_acts_in_a_round_of_five(tmp_path):
    """Issue #38 item 2, in the app: FedExP's default (``aggregation =
    "auto"``) clips with centered clipping in rounds of five replies, and
    every reply's clients.jsonl line says by how much and what the step
    guard saw."""
    run_in_process(
        {
            "output-dir": str(tmp_path),
            "run-name": "auto",
            "strategy": "fedexp",
            "num-server-rounds": 2,
            "clients-per-round": 5,
        },  # fmt: skip
        num_supernodes=5,
    )
    run = tmp_path / "auto"
    data = json.loads((run / "results.json").read_text())
    assert data["status"] == "completed"
    text = (run / "clients.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    scales = [line["center_clip_scale"] for line in lines]
    assert len(scales) == 10 and all(0 < s <= 1 for s in scales)
    # τ is the round's median distance from the centre: some are clipped
    assert sum(s < 1 for s in scales) >= 2
    assert all(r["strategy"]["center-clip-radius"] > 0 for r in data["rounds"])
    # the step guard leaves each client out of the clipped mean (stop 62):
    # every reply has the step the round would take without it, and the
    # round's step is at most the smallest of them
    for round_ in data["rounds"]:
        number = round_["round"]
        steps = [line["server_lr_without"] for line in lines
                 if line["round"] == number]  # fmt: skip
        assert len(steps) == 5 and all(s is not None and s >= 1 for s in steps)
        assert round_["strategy"]["server-lr"] <= min(steps) * (1 + 1e-9)
