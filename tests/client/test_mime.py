"""Mime and MimeLite with SGDm (Karimireddy et al. 2020a, Algorithm 1) on the hook.

The references below are written from the algorithm box (SGDm as the base
optimizer: U(g, m) = (1 − β)g + βm with m fixed during local steps,
V(g, m) = (1 − β)g + βm at the server), in float64 NumPy, with the
one-exchange reading of Mime's c documented in fedadapt.strategies.mime.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from flwr.common import Code, ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedadapt.client.local import train_round
from fedadapt.client.local_update import CLIENT_UPDATES, LocalStart
from fedadapt.client.mime import MimeClient, MimeLiteClient
from fedadapt.client.training import train_local
from fedadapt.config import ConfigError, validate_run_config
from fedadapt.strategies import FedAvg, Mime, MimeLite, wire
from fedadapt.strategies.legacy import FedAvg as LegacyFedAvg
from fedadapt.strategies.local_update import round_config
from fedadapt.tasks import TASKS
from tests.client.harness import (
    RUN_CONFIG,
    InProcessProxy,
    global_state,
    linear_model,
    make_contexts,
    message_rounds,
)
from tests.helpers import run_in_process

CPU = torch.device("cpu")


# --- a float64 reference of the algorithm box ----------------------------------------


def _grad(w, b, x, t):
    """∇ of the mean squared error of x ↦ x wᵀ + b (torch's MSELoss, mean)."""
    residual = x @ w.T + b - t
    return 2 / residual.size * residual.T @ x, 2 / residual.size * residual.sum(axis=0)


def _order(n: int, batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """The example indices of each local step (the loader's seeded shuffling)."""
    shuffle = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        TensorDataset(torch.arange(n)),
        batch_size=batch_size,
        shuffle=True,
        generator=shuffle,
    )
    batches: list[np.ndarray] = []
    while len(batches) < steps:
        batches += [b[0].numpy() for b in loader]
    return batches[:steps]


def _reference_client(x, data, m, c, beta, lr, batches):
    """K local steps of Alg. 1: y ← y − η((1 − β)g + βm), Mime's g corrected by c."""
    (w, b), (inputs, targets) = x, data
    for idx in batches:
        gw, gb = _grad(w, b, inputs[idx], targets[idx])
        if c is not None:  # Mime: g − ∇f_i(x; ζ) + c
            xw, xb = _grad(*x, inputs[idx], targets[idx])
            gw, gb = gw - xw + c[0], gb - xb + c[1]
        w = w - lr * ((1 - beta) * gw + beta * m[0])
        b = b - lr * ((1 - beta) * gb + beta * m[1])
    return (w, b), _grad(*x, inputs, targets)  # y_i and ∇f_i(x) (full batch)


def _client_round(name, x, data, config, arrays, lr, steps, batch_size, seed):
    """One client's round through the client half and train_local (float64)."""
    model = linear_model(*x)
    dataset = TensorDataset(*(torch.from_numpy(a) for a in data))
    client = CLIENT_UPDATES.get(name)()
    client.begin(
        LocalStart(
            model, config, arrays, None, dataset, nn.MSELoss(), batch_size, CPU, 1, lr
        )
    )
    train_local(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        nn.MSELoss(),
        dataset,
        epochs=0,
        steps=steps,
        batch_size=batch_size,
        seed=seed,
        device=CPU,
        classification=False,
        local_update=client,
    )
    end = client.end(model, steps)
    y = (model.weight.detach().numpy(), model.bias.detach().numpy())
    return y, end


@pytest.mark.parametrize("name", ["mime", "mimelite"])
def test_local_steps_match_a_float64_reference(name):
    """Five steps on minibatches of 4 of 12 examples (into a second epoch)."""
    rng = np.random.default_rng(1)
    data = rng.normal(size=(12, 3)), rng.normal(size=(12, 1))
    x = rng.normal(size=(1, 3)), rng.normal(size=(1,))
    m = rng.normal(size=(1, 3)), rng.normal(size=(1,))
    c = rng.normal(size=(1, 3)), rng.normal(size=(1,))
    beta, lr, steps = 0.8, 0.1, 5
    arrays = {"m/weight": m[0], "m/bias": m[1]}
    if name == "mime":
        arrays |= {"c/weight": c[0], "c/bias": c[1]}
    config = {f"{name}.beta": beta}
    y, end = _client_round(name, x, data, config, arrays, lr, steps, 4, seed=7)
    expected, grad_x = _reference_client(
        x, data, m, c if name == "mime" else None, beta, lr, _order(12, 4, steps, 7)
    )
    for got, want in zip(y, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(end.arrays["weight"], grad_x[0], rtol=1e-12)
    np.testing.assert_allclose(end.arrays["bias"], grad_x[1], rtol=1e-12)
    assert end.metrics[f"{name}-grad-norm"] == pytest.approx(
        np.sqrt(np.sum(grad_x[0] ** 2) + np.sum(grad_x[1] ** 2))
    )
    # not vacuous: plain SGD (and the other variant) end elsewhere
    plain, _ = _reference_client(
        x, data, (0 * m[0], 0 * m[1]), None, 0.0, lr, _order(12, 4, steps, 7)
    )
    other, _ = _reference_client(
        x, data, m, None if name == "mime" else c, beta, lr, _order(12, 4, steps, 7)
    )
    assert not np.allclose(y[0], plain[0]) and not np.allclose(y[0], other[0])


@pytest.mark.parametrize("server", [Mime, MimeLite])
def test_rounds_match_a_float64_reference(server):
    """Three rounds, two clients of 12 and 8 examples, the paper's x ← mean_S y_i.

    Server: m ← (1 − β)·ḡ + β·m with ḡ the example-weighted mean of the
    clients' ∇f_i(x); Mime's clients get c = the previous round's ḡ (none in
    round 1: MimeLite's step).
    """
    rng = np.random.default_rng(2)
    clients = [(rng.normal(size=(n, 3)), rng.normal(size=(n, 1))) for n in (12, 8)]
    sizes = np.array([12.0, 8.0])
    x0 = rng.normal(size=(1, 3)), rng.normal(size=(1,))
    beta, lr, steps, rounds = 0.9, 0.2, 3, 3
    update = server(beta=beta)

    x = x0  # through the two halves; the server step is FedAvg's mean, here
    for t in range(1, rounds + 1):
        model = {"weight": x[0], "bias": x[1]}
        config, arrays = round_config(update, t, model, num_nodes=2)
        replies, ys = [], []
        for i, data in enumerate(clients):
            y, end = _client_round(
                update.name, x, data, config, arrays, lr, steps, 4, seed=10 * t + i
            )
            assert update.check_reply(end.arrays, end.metrics) is None
            replies.append(end.arrays)
            ys.append(y)
        update.aggregate(replies, list(sizes))
        x = tuple(
            sum(s * y[k] for s, y in zip(sizes, ys, strict=True)) / sizes.sum()
            for k in (0, 1)
        )

    ref_x, m, c = x0, (np.zeros((1, 3)), np.zeros(1)), None
    for t in range(1, rounds + 1):
        ys, grads = [], []
        for i, data in enumerate(clients):
            batches = _order(len(data[0]), 4, steps, 10 * t + i)
            y, g = _reference_client(ref_x, data, m, c, beta, lr, batches)
            ys.append(y)
            grads.append(g)
        mean = [
            sum(s * g[k] for s, g in zip(sizes, grads, strict=True)) / sizes.sum()
            for k in (0, 1)
        ]
        m = tuple((1 - beta) * mean[k] + beta * m[k] for k in (0, 1))
        c = tuple(mean) if server is Mime else None
        ref_x = tuple(
            sum(s * y[k] for s, y in zip(sizes, ys, strict=True)) / sizes.sum()
            for k in (0, 1)
        )

    for got, want in zip(x, ref_x, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10)
    np.testing.assert_allclose(update.m["weight"], m[0], rtol=1e-12)
    np.testing.assert_allclose(update.m["bias"], m[1], rtol=1e-12)
    assert (update.c is None) == (server is MimeLite)
    # not vacuous: without Mime's correction (or momentum) the model differs
    assert not np.allclose(ref_x[0], x0[0])


# --- both Flower APIs, fedadapt's apps ------------------------------------------------


def _weighted_mean(arrays: list[dict], weights: list[float]) -> dict[str, np.ndarray]:
    return {
        k: sum(
            w * a[k].astype(np.float64) for a, w in zip(arrays, weights, strict=True)
        )
        / sum(weights)
        for k in arrays[0]
    }


@pytest.mark.usefixtures("task_identity")
def test_message_api_server_momentum_from_the_clients_full_batch_gradients():
    contexts = make_contexts(2)
    strategy = FedAvg(local_update=Mime(), min_train_nodes=2, min_available_nodes=2)
    x = {k: v.numpy() for k, v in global_state().items()}
    sent: list = []
    message_rounds(strategy, contexts, 1, sent.extend)
    grads = [
        {k: v.numpy() for k, v in r.content[wire.LOCAL_ARRAYS].items()} for r in sent
    ]
    weights = [float(r.content[wire.METRICS][wire.NUM_EXAMPLES]) for r in sent]
    # each client sent ∇f_i(x): the gradient of its mean loss over its whole split
    cfg = validate_run_config(RUN_CONFIG)
    task = TASKS.get(cfg["task"])
    for reply, grad in zip(sent, grads, strict=True):
        node = reply.metadata.src_node_id
        data = task.load_client(cfg, node - 1, 2).train
        inputs, targets = next(iter(DataLoader(data, batch_size=len(data))))
        model = task.build_model()
        model.load_state_dict({k: torch.from_numpy(v) for k, v in x.items()})
        task.criterion()(model(inputs), targets).backward()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(grad[name], p.grad.numpy(), rtol=1e-4, atol=1e-6)
    g1 = _weighted_mean(grads, weights)
    for k, g in g1.items():
        np.testing.assert_allclose(strategy.local_update.m[k], 0.1 * g, rtol=1e-12)
        np.testing.assert_allclose(strategy.local_update.c[k], g, rtol=1e-12)
    sent.clear()
    x2 = strategy.training_arrays.to_torch_state_dict()
    message_rounds(strategy, contexts, 1, sent.extend, first=2)
    grads = [
        {k: v.numpy() for k, v in r.content[wire.LOCAL_ARRAYS].items()} for r in sent
    ]
    weights = [float(r.content[wire.METRICS][wire.NUM_EXAMPLES]) for r in sent]
    g2 = _weighted_mean(grads, weights)
    for k, g in g2.items():
        np.testing.assert_allclose(
            strategy.local_update.m[k], 0.1 * g + 0.9 * (0.1 * g1[k]), rtol=1e-12
        )
    # the round-2 step used m and c: plain SGD from the same x and seed differs
    plain = train_round(cfg, 0, 2, x2, lr=0.1, server_round=2)
    node_1 = next(r for r in sent if r.metadata.src_node_id == 1)
    assert not np.allclose(
        node_1.content[wire.ARRAYS]["net.1.weight"].numpy(),
        plain.state["net.1.weight"].numpy(),
    )
    # Mime keeps no client state
    assert not any("mime" in name for c in contexts.values() for name in c.state)
    # the server half's state survives the records round trip (a resume)
    again = FedAvg(local_update=Mime())
    again.load_state_records(strategy.state_to_records())
    model = {k: v.numpy() for k, v in x2.items()}
    before = round_config(strategy.local_update, 3, model, 2)[1]
    after = round_config(again.local_update, 3, model, 2)[1]
    assert set(before) == set(after) == {f"{p}/{k}" for p in "mc" for k in g2}
    for k, v in before.items():
        assert v.dtype == np.float32  # sent in the model's dtype
        np.testing.assert_array_equal(after[k], v)


def test_legacy_api_matches_the_message_api(task_identity):
    keys = list(global_state())
    manager = SimpleClientManager()
    for proxy in (InProcessProxy(c) for c in make_contexts(2).values()):
        manager.register(proxy)
    strategy = LegacyFedAvg(
        local_update=MimeLite(),
        array_names=keys,
        min_fit_clients=2,
        min_available_clients=2,
        on_fit_config_fn=lambda r: {wire.LR: 0.1, wire.SERVER_ROUND: r},
    )
    parameters = ndarrays_to_parameters([v.numpy() for v in global_state().values()])
    for server_round in (1, 2):
        pairs = strategy.configure_fit(server_round, parameters, manager)
        names = json.loads(pairs[0][1].config.get(wire.LOCAL_ARRAYS, "[]"))
        assert len(names) == (0 if server_round == 1 else len(keys))  # m from round 2
        results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
        assert all(r.status.code == Code.OK for _, r in results)
        parameters, _ = strategy.aggregate_fit(server_round, results, [])
        assert strategy.round_reports[server_round]["train_replies"]["used"] == 2
    message = FedAvg(local_update=MimeLite(), min_train_nodes=2, min_available_nodes=2)
    message_rounds(message, make_contexts(2), 2)
    for k, m in message.local_update.m.items():
        np.testing.assert_array_equal(strategy.local_update.m[k], m)
    assert strategy.local_update.c is None  # MimeLite sends no c


# --- run config, combination with FedDuA ---------------------------------------------


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_feddua_with_mime_is_built_from_the_run_config(api):
    from fedadapt.server.strategy_factory import build_strategy

    cfg = validate_run_config(
        {"strategy": "feddua", "local-update": "mime", "mime.beta": 0.5}
    )
    strategy = build_strategy(cfg, 2, api=api)
    assert type(strategy.local_update) is Mime
    assert strategy.local_update.beta == 0.5
    assert type(strategy.rule).__name__ == "FedDuARule"


@pytest.mark.parametrize("name", ["mime", "mimelite"])
@pytest.mark.parametrize("optimizer", ["adam", "sgdm", "delta-sgd"])
def test_run_config_requires_plain_sgd_clients(name, optimizer):
    with pytest.raises(ConfigError, match=f"local-update='{name}' .* client-optimizer"):
        validate_run_config({"local-update": name, "client-optimizer": optimizer})
    assert validate_run_config({"local-update": name})[f"{name}.beta"] == 0.9
    with pytest.raises(ConfigError, match=rf"{name}.beta.*must be < 1"):
        validate_run_config({"local-update": name, f"{name}.beta": 1.0})


# --- bad input ----------------------------------------------------------------------


def test_server_half_rejects_unusable_gradients():
    update = Mime()
    model = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}
    update.configure(1, model, 2)
    good = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
    assert "full-batch gradient" in update.check_reply(None, {})
    assert "matches no model array" in update.check_reply({"w": np.ones(6)}, {})
    assert "not finite" in update.check_reply({**good, "b": np.array([1, np.nan])}, {})
    assert "not a floating-point" in update.check_reply(
        {"w": np.ones((2, 3), np.int64)}, {}
    )
    assert update.check_reply(good, {}) is None
    assert "differ" in update.check_reply({"w": good["w"]}, {})  # not as the first
    update.aggregate([good, good], [1.0, 3.0])
    update.configure(2, model, 2)
    assert "differ" in update.check_reply({"w": good["w"]}, {})  # not as m
    assert update.check_reply(good, {}) is None


@pytest.mark.parametrize("client", [MimeClient, MimeLiteClient])
def test_client_half_refuses_a_bad_server_message(client):
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.zeros(4, 3), torch.zeros(4, 1))

    def begin(config: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        client().begin(
            LocalStart(model, config, arrays, None, data, nn.MSELoss(), 2, CPU, 2, 0.1)
        )

    beta = {f"{client.name}.beta": 0.9}
    with pytest.raises(ValueError, match=rf"{client.name}.beta must be a number"):
        begin({}, {})
    with pytest.raises(ValueError, match="do not match this model's trainable"):
        begin(beta, {"m/weight": np.zeros((1, 3))})  # no m/bias
    with pytest.raises(ValueError, match="do not match this model's trainable"):
        begin(beta, {"m/weight": np.zeros((3, 1)), "m/bias": np.zeros(1)})
    with pytest.raises(ValueError, match="unexpected server arrays"):
        begin(beta, {"weight": np.zeros((1, 3))})
    if client is MimeLiteClient:
        with pytest.raises(ValueError, match="unexpected server arrays"):
            begin(beta, {"c/weight": np.zeros((1, 3)), "c/bias": np.zeros(1)})


# --- end to end through Flower -------------------------------------------------------


# a Ray simulation of ~40 s: with make test-deploy (CI runs it), to keep
# the default suite within CI's 20 minutes; unit references cover the algorithm
@pytest.mark.deploy
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("strategy", "name"),
    [("feddua", "mime")],  # MimeLite: by hand, both APIs
)
def test_mime_runs_in_flower_simulation(tmp_path, strategy, name):
    """local-update=mime(lite) with FedAvg, and with FedDuA (FedDuA Fig. 4)."""
    run_in_process(
        {
            "output-dir": str(tmp_path),
            "run-name": "mime",
            "num-server-rounds": 2,
            "strategy": strategy,
            "local-update": name,
            "local-steps": 5,
        },
        num_supernodes=2,
    )
    data = json.loads((tmp_path / "mime" / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["local_update"] == {"name": name, "beta": 0.9}
    for r in data["rounds"]:
        assert r["replies"]["used"] == 2
        assert r["train"][f"{name}-grad-norm"] > 0  # the client half ran
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]
