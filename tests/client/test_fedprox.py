"""FedProx on every client optimizer (#29 item 1): Δ-SGD and Fed-LAMB.

The proximal term (μ/2)‖w − w_t‖² of Li et al. 2020 (Alg. 2 line 5) joins
the local loss inside the optimizer's closure, so Δ-SGD's same-batch mode
(Kim et al., ICLR 2024, Alg. 1) has it in both gradient passes and Fed-LAMB
(Karimi et al. 2021, Alg. 1) steps on ∇F + μ(w − w_t). FedProx with SGD and
its algorithm box: tests/test_local_update.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context
from flwr.common import Code, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from torch import nn
from torch.utils.data import TensorDataset

from fedadapt.client.fedprox import FedProxClient
from fedadapt.client.local import train_round
from fedadapt.client.local_update import LocalStart
from fedadapt.client.training import train_local
from fedadapt.config import validate_run_config
from fedadapt.optimizers import OPTIMIZERS
from fedadapt.optimizers.fedlamb import FedLAMB as FedLAMBOptimizer
from fedadapt.strategies import FedLAMB, FedProx, wire
from fedadapt.strategies.legacy import FedLAMB as LegacyFedLAMB
from fedadapt.tasks import TASKS
from tests.client.harness import (
    RUN_CONFIG,
    InProcessProxy,
    global_state,
    linear_model,
    make_contexts,
    message_rounds,
)

CPU = torch.device("cpu")
PROX = {wire.LOCAL_UPDATE: "fedprox"}


def _linear_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12, 4)) * np.array([3.0, 1.0, 0.5, 0.2])  # uneven curvature
    t = rng.normal(size=(12, 1))
    return x, t, rng.normal(size=(1, 4)), rng.normal(size=(1,))


def _train_with_prox(model, optimizer, x, t, mu, steps, lr):
    """FedProx's client half in fedadapt's local loop, one full batch per step."""
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(t))
    prox = FedProxClient()
    prox.begin(
        LocalStart(
            model, {"fedprox.mu": mu}, {}, None, data, nn.MSELoss(), len(x), CPU, 1, lr
        )
    )
    train_local(
        model,
        optimizer,
        nn.MSELoss(),
        data,
        epochs=0,
        steps=steps,
        batch_size=len(x),
        seed=0,
        device=CPU,
        classification=False,
        local_update=prox,
    )


# --- Δ-SGD (same-batch mode) ---------------------------------------------------------


def _delta_sgd_reference(x, t, w0, b0, *, mu, lr, steps, prox_in_second_pass=True):
    """Δ-SGD Alg. 1 (+ App. B.1's δ) on h = F + (μ/2)‖w − w_t‖², float64 NumPy.

    F is the mean squared error of a linear model over the full batch, so the
    "same batch" of both passes is the whole data set. Per step k:
    g̃(z) = ∇F(z) + μ(z − w_t);  k = 0: η_0 = η0, θ_0 = 1;
    k ≥ 1: η_k = min{γ‖x_k − x_{k−1}‖ / (2‖g̃(x_k) − g̃(x_{k−1})‖),
    √(1 + δθ_{k−1}) η_{k−1}}, θ_k = η_k/η_{k−1};  x_{k+1} = x_k − η_k g̃(x_k).
    ``prox_in_second_pass=False`` drops μ(z − w_t) from g̃(x_{k−1}) (a wrong
    client; shows the test would see it). Returns (w, b, branches).
    """
    gamma, delta = 2.0, 0.1
    start = np.concatenate([w0.ravel(), b0])

    def grad(z: np.ndarray, prox: bool = True) -> np.ndarray:
        w, b = z[:4].reshape(1, 4), z[4:]
        residual = x @ w.T + b - t
        g = np.concatenate(
            [(2 / len(x) * residual.T @ x).ravel(), 2 / len(x) * residual.sum(axis=0)]
        )
        return g + mu * (z - start) if prox else g

    z, prev, eta, theta, branches = start.copy(), None, lr, 1.0, []
    for k in range(steps):
        g = grad(z)
        if k > 0:
            dx = np.linalg.norm(z - prev)
            dg = np.linalg.norm(g - grad(prev, prox_in_second_pass))
            grown = math.sqrt(1 + delta * theta) * eta
            smooth = gamma * dx / (2 * dg)
            branches.append("smoothness" if smooth < grown else "growth")
            new_eta = min(smooth, grown)
            theta, eta = new_eta / eta, new_eta
        prev, z = z, z - eta * g
    return z[:4].reshape(1, 4), z[4:], branches


def test_fedprox_with_delta_sgd_has_the_term_in_both_same_batch_passes():
    """FedProx + Δ-SGD (same-batch): both gradient passes include μ(w − w_t)."""
    x, t, w0, b0 = _linear_problem()
    mu, lr, steps = 0.5, 0.2, 6
    model = linear_model(w0, b0)
    cfg = validate_run_config({"client-optimizer": "delta-sgd"})
    _train_with_prox(
        model, OPTIMIZERS.get("delta-sgd")(model, lr, cfg), x, t, mu, steps, lr
    )
    w, b, branches = _delta_sgd_reference(x, t, w0, b0, mu=mu, lr=lr, steps=steps)
    np.testing.assert_allclose(model.weight.detach().numpy(), w, rtol=1e-10)
    np.testing.assert_allclose(model.bias.detach().numpy(), b, rtol=1e-10)
    # not vacuous: the smoothness estimate set some steps, and a client whose
    # second pass lacked the proximal term would end elsewhere
    assert "smoothness" in branches
    w_bad, _, _ = _delta_sgd_reference(
        x, t, w0, b0, mu=mu, lr=lr, steps=steps, prox_in_second_pass=False
    )
    assert not np.allclose(w_bad, w, rtol=1e-6)


# --- Fed-LAMB ----------------------------------------------------------------------


def test_fedprox_with_fed_lamb_steps_on_the_proximal_gradient():
    """Fed-LAMB with FedProx = Fed-LAMB given ∇F + μ(w − w_t), step by step."""
    x, t, w0, b0 = _linear_problem(1)
    mu, lr, steps = 0.3, 0.05, 5
    model = linear_model(w0, b0)
    _train_with_prox(
        model, FedLAMBOptimizer(model.parameters(), lr=lr), x, t, mu, steps, lr
    )
    # the oracle: the unchanged optimizer stepped on the proximal gradient,
    # formed by hand (no closure, no hook)
    ref = linear_model(w0, b0)
    start = [p.detach().clone() for p in ref.parameters()]
    optimizer = FedLAMBOptimizer(ref.parameters(), lr=lr)
    inputs, targets = torch.from_numpy(x), torch.from_numpy(t)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(ref(inputs), targets).backward()
        with torch.no_grad():
            for p, p0 in zip(ref.parameters(), start, strict=True):
                p.grad += mu * (p - p0)
        optimizer.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)
    plain = linear_model(w0, b0)
    _train_with_prox(
        plain, FedLAMBOptimizer(plain.parameters(), lr=lr), x, t, 0.0, steps, lr
    )
    assert not torch.allclose(plain.weight, model.weight)  # μ acted


def _cfg(**overrides: Any) -> dict[str, Any]:
    base = {
        "task": "digits-mlp",
        "local-steps": 4,
        "batch-size": 16,
        "client-optimizer": "fed-lamb",
        "strategy": "fed-lamb",
    }
    return validate_run_config({**base, **overrides})


def test_fedprox_mu_zero_with_fed_lamb_is_the_plain_client_bit_for_bit():
    """μ = 0 with Fed-LAMB: same model and same second moments as no FedProx."""
    cfg, state = _cfg(), global_state()
    names = [n for n, _ in TASKS.get("digits-mlp").build_model().named_parameters()]
    v_hat = {n: np.full(tuple(state[n].shape), 1e-3, np.float32) for n in names}

    def run(config: dict[str, Any]):
        # a lone local update's arrays travel unprefixed, combined ones as
        # <name>/<key> (fedadapt.strategies.local_update.LocalUpdates)
        prefix = "fed-lamb/" if "+" in config[wire.LOCAL_UPDATE] else ""
        arrays = {prefix + n: v for n, v in v_hat.items()}
        result = train_round(
            cfg, 0, 3, state, lr=0.01, server_round=2, config=config,
            local_arrays=arrays,
        )  # fmt: skip
        moments = {k.removeprefix(prefix): v for k, v in result.local_arrays.items()}
        return result, moments

    both = {wire.LOCAL_UPDATE: "fed-lamb+fedprox"}
    (plain, plain_v), (zero, zero_v) = (
        run({wire.LOCAL_UPDATE: "fed-lamb"}),
        run({**both, "fedprox.mu": 0.0}),
    )
    prox, _ = run({**both, "fedprox.mu": 1.0})
    for key, value in plain.state.items():
        assert torch.equal(zero.state[key], value), key
    assert set(plain_v) == set(names) == set(zero_v)
    for name, v in plain_v.items():
        np.testing.assert_array_equal(zero_v[name], v)
    assert not all(torch.equal(prox.state[k], v) for k, v in plain.state.items())
    assert prox.metrics["fedprox-term"] > 0


def _contexts(num: int) -> dict[int, Context]:
    """Nodes as in tests/test_local_update.py, with Fed-LAMB clients."""
    fed_lamb = {"client-optimizer": "fed-lamb", "strategy": "fed-lamb"}
    return make_contexts(num, {**RUN_CONFIG, **fed_lamb})


@pytest.mark.usefixtures("task_identity")
def test_fedprox_with_fed_lamb_strategy_message_api():
    """strategy FedLAMB + local update FedProx + Fed-LAMB clients (ClientApp)."""
    strategy = FedLAMB(
        local_update=FedProx(mu=0.1), min_train_nodes=2, min_available_nodes=2
    )

    def sent(server_round, messages):
        # round 2 carries the server's v̂ next to the model, with μ in the config
        assert (wire.LOCAL_ARRAYS in messages[0].content) == (server_round > 1)
        assert messages[0].content[wire.CONFIG]["fedprox.mu"] == 0.1

    reports = message_rounds(strategy, _contexts(2), 2, lr=0.01, messages_hook=sent)
    for metrics, report in reports:
        assert metrics is not None and metrics["fedprox-term"] > 0
        assert report["train_replies"]["used"] == 2
    assert (
        strategy.local_update.updates[0].v_hat is not None
    )  # the clients' v reached the server


def test_fedprox_with_fed_lamb_strategy_legacy_api():
    """The same with the legacy FedLAMB and fedadapt's NumPyClient."""
    manager = SimpleClientManager()
    for context in _contexts(2).values():
        manager.register(InProcessProxy(context))
    state = global_state()
    strategy = LegacyFedLAMB(
        local_update=FedProx(mu=0.1),
        array_names=list(state),
        min_fit_clients=2,
        min_available_clients=2,
        on_fit_config_fn=lambda r: {wire.LR: 0.01},
        fit_metrics_aggregation_fn=lambda pairs: {
            "fedprox-term": min(m["fedprox-term"] for _, m in pairs)
        },
    )
    parameters = ndarrays_to_parameters([v.numpy() for v in state.values()])
    for server_round in (1, 2):
        pairs = strategy.configure_fit(server_round, parameters, manager)
        assert pairs[0][1].config["fedprox.mu"] == 0.1
        sent = len(parameters_to_ndarrays(pairs[0][1].parameters))
        assert sent == len(state) + (
            len(list(strategy.local_update.updates[0].v_hat or {}))
        )
        results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
        assert all(r.status.code == Code.OK for _, r in results)
        new, metrics = strategy.aggregate_fit(server_round, results, [])
        assert new is not None
        assert metrics["fedprox-term"] > 0
        assert strategy.round_reports[server_round]["train_replies"]["used"] == 2
        parameters = new
    assert strategy.local_update.updates[0].v_hat is not None
