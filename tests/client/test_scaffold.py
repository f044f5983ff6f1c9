"""SCAFFOLD option II on the local-update hook (#29): both halves, both APIs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from torch import nn
from torch.utils.data import TensorDataset

from fedadapt.client import client_app
from fedadapt.client.local import train_round
from fedadapt.client.local_update import LocalStart
from fedadapt.client.scaffold import ScaffoldClient
from fedadapt.client.training import train_local
from fedadapt.config import validate_run_config
from fedadapt.strategies import FedAvg, FedAvgM, FedDuA, Scaffold, wire
from fedadapt.strategies.legacy import FedDuA as LegacyFedDuA
from fedadapt.tasks import TASKS
from tests.client.harness import (
    RUN_CONFIG,
    Grid,
    InProcessProxy,
    global_state,
    linear_model,
    make_contexts,
    message_rounds,
)
from tests.helpers import run_in_process, run_legacy_in_process

# --- the client's local steps against Algorithm 1 ------------------------------------


def test_local_steps_match_a_float64_reference():
    """Lines 9-13, option II, with clipping and weight decay before the correction.

    f_i = mean squared error of a linear model (full batch, so the order of
    samples does not matter); per step g = clip(∇f_i(y)) + λy, then
    y ← y − η_l(g − c_i + c); c_i⁺ = c_i − c + (x − y)/(K η_l).
    """
    rng = np.random.default_rng(1)
    x_in, t = rng.normal(size=(12, 4)), rng.normal(size=(12, 1))
    w0, b0 = rng.normal(size=(1, 4)), rng.normal(size=(1,))
    c = {"weight": rng.normal(size=(1, 4)), "bias": rng.normal(size=(1,))}
    c_i = {"weight": rng.normal(size=(1, 4)), "bias": rng.normal(size=(1,))}
    lr, steps, clip, wd = 0.05, 3, 0.5, 0.1
    model = linear_model(w0, b0)
    data = TensorDataset(torch.from_numpy(x_in), torch.from_numpy(t))
    client = ScaffoldClient()
    client.begin(
        LocalStart(model, {wire.LOCAL_UPDATE: "scaffold"}, c, dict(c_i), data,
                   nn.MSELoss(), 12, torch.device("cpu"), 1, lr)
    )  # fmt: skip
    result = train_local(
        model, torch.optim.SGD(model.parameters(), lr=lr), nn.MSELoss(), data,
        epochs=0, steps=steps, batch_size=12, seed=0, device=torch.device("cpu"),
        classification=False, weight_decay=wd, grad_clip=clip, local_update=client,
    )  # fmt: skip
    end = client.end(model, result.steps)

    y = {"weight": w0.copy(), "bias": b0.copy()}
    for _ in range(steps):
        residual = x_in @ y["weight"].T + y["bias"] - t
        grad = {
            "weight": 2 / len(x_in) * residual.T @ x_in,
            "bias": 2 / len(x_in) * residual.sum(axis=0),
        }
        norm = np.sqrt(sum(np.sum(g**2) for g in grad.values()))
        scale = min(1.0, clip / (norm + 1e-6))  # torch's clip_grad_norm_
        for k in y:
            g = grad[k] * scale + wd * y[k]
            y[k] = y[k] - lr * (g - c_i[k] + c[k])
    x = {"weight": w0, "bias": b0}
    for k in y:
        np.testing.assert_allclose(getattr(model, k).detach().numpy(), y[k], rtol=1e-12)
        c_plus = c_i[k] - c[k] + (x[k] - y[k]) / (steps * lr)
        np.testing.assert_allclose(end.state[k], c_plus, rtol=1e-10)
        np.testing.assert_allclose(end.arrays[k], c_plus - c_i[k], rtol=1e-10)
    assert end.metrics == {}  # no reset
    assert scale < 1  # the clipping acted (and the correction was not clipped)


# --- rounds: server and clients against Algorithm 1 ---------------------------------

LINREG = {"task": "synthetic-linreg", "local-steps": 3, "batch-size": 30}


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("eta_g", [1.0, 2.0])
def test_rounds_with_partial_participation_match_a_float64_reference(eta_g):
    """Three rounds, 2 of N = 3 nodes each: lines 6-17 of Algorithm 1.

    The reference keeps x, c and every c_i in float64; each sampled client
    takes K full-batch steps of y ← y − η_l(∇f_i(y) − c_i + c) on its
    (1/2n)‖Xy − t‖²; x ← x + η_g·mean(y_i − x) (equal num-examples),
    c ← c + (1/N) Σ Δc_i. η_g is the strategy's: FedAvg (η_g = 1), FedAvgM
    with momentum 0 (η_g = 2).
    """
    num, lr, steps = 3, 0.1, LINREG["local-steps"]
    cfg = validate_run_config(LINREG)
    task = TASKS.get("synthetic-linreg")
    data = []
    for pid in range(num):
        tensors = task.load_client(cfg, pid, num).train.tensors
        data.append(tuple(a.double().numpy() for a in tensors))
    contexts = {
        node: Context(1, node, {"partition-id": node - 1, "num-partitions": num},
                      RecordDict(), dict(LINREG))
        for node in range(1, num + 1)
    }  # fmt: skip
    # the reference averages the two sampled updates as they are: the
    # projection (two clients that disagree) and the pull cap off
    kwargs = dict(local_update=Scaffold(), fraction_train=0.5, min_train_nodes=2,
                  min_available_nodes=num, project_opposing=False,
                  max_contribution_ratio=0.0)  # fmt: skip
    strategy = (
        FedAvg(**kwargs) if eta_g == 1
        else FedAvgM(server_learning_rate=eta_g, server_momentum=0.0, **kwargs)
    )  # fmt: skip
    torch.manual_seed(0)
    arrays = ArrayRecord(task.build_model().state_dict())
    x = {
        k: v.numpy().astype(np.float64) for k, v in arrays.to_torch_state_dict().items()
    }
    c = {k: np.zeros_like(v) for k, v in x.items()}
    c_i = [{k: np.zeros_like(v) for k, v in x.items()} for _ in range(num)]
    for server_round in (1, 2, 3):
        messages = strategy.configure_train(
            server_round, arrays, ConfigRecord({wire.LR: lr}), Grid(list(contexts))
        )
        replies = [
            client_app.train(m, contexts[m.metadata.dst_node_id]) for m in messages
        ]
        new, _ = strategy.aggregate_train(server_round, replies)
        assert new is not None
        arrays = new
        sampled = [m.metadata.dst_node_id - 1 for m in messages]
        assert len(sampled) == 2
        ys, deltas = [], []
        for i in sampled:
            inputs, targets = data[i]
            y = {k: v.copy() for k, v in x.items()}
            for _ in range(steps):
                w = y["linear.weight"]
                grad = (inputs @ w[0] - targets) @ inputs / len(inputs)
                y["linear.weight"] = w - lr * (grad[None, :] - c_i[i]["linear.weight"]
                                               + c["linear.weight"])  # fmt: skip
            plus = {k: c_i[i][k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in x}
            deltas.append({k: plus[k] - c_i[i][k] for k in x})
            c_i[i] = plus
            ys.append(y)
        x = {k: x[k] + eta_g * sum(y[k] - x[k] for y in ys) / len(ys) for k in x}
        c = {k: c[k] + sum(d[k] for d in deltas) / num for k in c}  # 1/N, not 1/|S|
        got = arrays.to_torch_state_dict()["linear.weight"].numpy()
        np.testing.assert_allclose(got, x["linear.weight"], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(
            strategy.local_update.c["linear.weight"], c["linear.weight"],
            rtol=1e-4, atol=1e-6,
        )  # fmt: skip
    assert np.abs(c["linear.weight"]).max() > 1e-3  # the correction mattered


# --- FedDuA + SCAFFOLD in both APIs, by hand ------------------------------------------


@pytest.mark.usefixtures("task_identity")
def test_feddua_with_scaffold_gives_the_same_rounds_in_both_apis():
    """Message-API FedDuA and legacy FedDuA, both with Scaffold(), 3 rounds:
    the same models and c, bit for bit (the APIs share one code path)."""
    message = FedDuA(local_update=Scaffold(), min_train_nodes=2,
                     min_available_nodes=2)  # fmt: skip
    reports = message_rounds(message, make_contexts(2), 3)
    assert all(r["train_replies"]["used"] == 2 for _, r in reports)
    assert reports[-1][1]["diagnostics"]["scaffold-c-norm"] > 0

    manager = SimpleClientManager()
    for context in make_contexts(2).values():
        manager.register(InProcessProxy(context))
    state = global_state()
    keys = list(state)
    legacy = LegacyFedDuA(
        local_update=Scaffold(), array_names=keys, min_fit_clients=2,
        min_available_clients=2,
        on_fit_config_fn=lambda r: {wire.LR: 0.1, wire.SERVER_ROUND: r},
    )  # fmt: skip
    parameters = ndarrays_to_parameters([v.numpy() for v in state.values()])
    for server_round in (1, 2, 3):
        pairs = legacy.configure_fit(server_round, parameters, manager)
        results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
        new, _ = legacy.aggregate_fit(server_round, results, [])
        assert new is not None
        parameters = new
        assert legacy.round_reports[server_round]["train_replies"]["used"] == 2
    got = dict(zip(keys, parameters_to_ndarrays(parameters), strict=True))
    want = message.latest_arrays.to_torch_state_dict()  # both: (w_t + w_{t+1})/2
    for key in keys:
        np.testing.assert_array_equal(got[key], want[key].numpy())
    for key, c in message.local_update.c.items():
        np.testing.assert_array_equal(legacy.local_update.c[key], c)


# --- bad input: a lost c_i, bad replies; the server state in checkpoints ------------


@pytest.mark.usefixtures("task_identity")
def test_a_corrupt_client_variate_is_reset_counted_and_kept_out_of_c(caplog):
    """Node 1's c_i is corrupt in round 2: it steps uncorrected (as plain SGD),
    sends Δc_i = 0, reports the reset; c moves by node 2's Δc_i only."""
    contexts = make_contexts(2)
    strategy = FedAvg(local_update=Scaffold(), min_train_nodes=2, min_available_nodes=2)
    message_rounds(strategy, contexts, 1)
    c_1 = {k: v.copy() for k, v in strategy.local_update.c.items()}
    assert any(np.abs(v).max() > 0 for v in c_1.values())
    x_2 = strategy.training_arrays.to_torch_state_dict()
    contexts[1].state["local-update.scaffold.layout"] = ConfigRecord({"layout": "{"})
    sent: list = []
    ((metrics, report),) = message_rounds(strategy, contexts, 1, sent.extend, first=2)
    assert report["train_replies"]["used"] == 2  # no crash, no rejection
    assert "client state reset" in caplog.text
    by_node = {r.metadata.src_node_id: r for r in sent}
    n_1, n_2 = (by_node[i].content[wire.METRICS][wire.NUM_EXAMPLES] for i in (1, 2))
    assert by_node[1].content[wire.METRICS][wire.LOCAL_STATE_RESET] == 1
    assert metrics[wire.LOCAL_STATE_RESET] == pytest.approx(n_1 / (n_1 + n_2))
    delta_1 = by_node[1].content[wire.LOCAL_ARRAYS]
    delta_2 = by_node[2].content[wire.LOCAL_ARRAYS]
    assert all(not np.any(delta_1[k].numpy()) for k in c_1)
    for key, c in strategy.local_update.c.items():
        np.testing.assert_allclose(c, c_1[key] + delta_2[key].numpy() / 2, rtol=1e-6)
    plain = train_round(validate_run_config(RUN_CONFIG), 0, 2, x_2, lr=0.1,
                        server_round=2)  # fmt: skip
    for key, value in plain.state.items():  # c_i := c: no correction at all
        assert np.array_equal(
            by_node[1].content[wire.ARRAYS][key].numpy(), value.numpy()
        )
    # the new c_i⁺ was kept: round 3 reads it without a reset
    (metrics, _), = message_rounds(strategy, contexts, 1, first=3)  # fmt: skip
    assert wire.LOCAL_STATE_RESET not in metrics


def test_a_kept_variate_that_does_not_fit_the_model_is_reset():
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.zeros(4, 3), torch.zeros(4, 1))
    client = ScaffoldClient()
    state = {"weight": np.ones((2, 2), np.float32), "bias": np.ones(1, np.float32)}
    assert client.check_state(state) is None  # finite floats: only the model can tell
    client.begin(LocalStart(model, {}, {}, state, data, nn.MSELoss(), 4,
                            torch.device("cpu"), 2, 0.1))  # fmt: skip
    end = client.end(model, 1)
    assert end.metrics == {wire.LOCAL_STATE_RESET: 1.0}
    assert all(not np.any(a) for a in end.arrays.values())
    assert (
        client.check_state({"weight": np.array([np.nan])})
        == "c_i 'weight' is not finite"
    )
    with pytest.raises(
        ValueError, match=r"scaffold: the server's c has arrays \['w'\]"
    ):
        ScaffoldClient().begin(
            LocalStart(model, {}, {"w": np.zeros(3)}, None, data, nn.MSELoss(), 4,
                       torch.device("cpu"), 2, 0.1)
        )  # fmt: skip


def test_server_half_screens_replies_and_checkpoints_c():
    from fedadapt.server.strategy_factory import build_strategy

    model = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}
    update = Scaffold()
    assert update.configure(1, model, 4) == ({}, {})  # c = 0: nothing sent yet
    good = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
    assert update.check_reply(None, {}) == (
        "expected Δc_i, one array per trainable model array"
    )
    assert "not a model array" in update.check_reply({**good, "v": good["b"]}, {})
    assert "has shape (3,)" in update.check_reply({**good, "b": np.ones(3)}, {})
    assert "not finite" in update.check_reply({**good, "b": np.array([1, np.inf])}, {})
    assert "not a float array" in update.check_reply({**good, "b": np.ones(2, int)}, {})
    assert update.check_reply(good, {}) is None  # fixes the round's names
    assert "expected Δc_i for ['b', 'w']" in update.check_reply({"w": good["w"]}, {})
    diagnostics = update.aggregate([good, good], [1.0, 5.0])  # unweighted, 1/N
    np.testing.assert_array_equal(update.c["w"], np.full((2, 3), 0.5))
    assert diagnostics["scaffold-c-norm"] == pytest.approx(np.sqrt(8 * 0.25))
    assert set(update.configure(2, model, 4)[1]) == {"w", "b"}

    strategy = FedDuA(local_update=update)
    again = FedDuA(local_update=Scaffold())
    again.load_state_records(strategy.state_to_records())
    for key, c in update.c.items():
        np.testing.assert_array_equal(again.local_update.c[key], c)
    fresh = FedDuA(local_update=Scaffold())
    fresh.load_state_records(FedDuA(local_update=Scaffold()).state_to_records())
    assert fresh.local_update.c is None

    cfg = validate_run_config({"task": "digits-mlp", "local-update": "scaffold"})
    assert isinstance(build_strategy(cfg, 2).local_update, Scaffold)
    assert isinstance(build_strategy(cfg, api="legacy").local_update, Scaffold)


# --- end to end through Flower -------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("strategy", "api"),
    [("feddua", "legacy")],  # the Message API: by hand, bit for bit
)
def test_scaffold_runs_in_flower_simulation(tmp_path, strategy, api):
    """local-update=scaffold with FedAvg and FedDuA (Fig. 4's combination).

    FedDuA + SCAFFOLD in the Message API: the by-hand test above gives the
    same rounds as the legacy API, bit for bit."""
    overrides: dict[str, Any] = {
        "output-dir": str(tmp_path), "run-name": "sc", "num-server-rounds": 2,
        "task": "synthetic-linreg", "batch-size": 30, "local-steps": 3,
        "strategy": strategy, "local-update": "scaffold",
    }  # fmt: skip
    if api == "message":
        run_in_process(overrides, num_supernodes=2)
    else:
        run_legacy_in_process(overrides, num_supernodes=2)
    data = json.loads((tmp_path / "sc" / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["local_update"] == {"name": "scaffold"}
    assert (data["config"]["strategy"], data["config"]["local-update"]) == (
        strategy,
        "scaffold",
    )
    for r in data["rounds"]:
        assert r["replies"]["used"] == 2
        assert r["strategy"]["scaffold-c-norm"] > 0  # the server half ran
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
