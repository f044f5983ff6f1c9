"""FedDyn (Acar et al., ICLR 2021, Algorithm 1): both halves against float64
references, partial participation, both Flower APIs, the run config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from torch import nn
from torch.utils.data import TensorDataset

from fedadapt.client import client_app
from fedadapt.client.feddyn import FedDynClient
from fedadapt.client.local_update import LocalStart
from fedadapt.client.training import train_local
from fedadapt.config import ConfigError, validate_run_config
from fedadapt.server.strategy_factory import build_strategy
from fedadapt.strategies import FedDyn, FedDynLocal, FedProx, LocalUpdates, wire
from fedadapt.strategies.feddyn import FedDynRule
from fedadapt.strategies.legacy import FedDyn as LegacyFedDyn
from fedadapt.tasks import TASKS
from fedadapt.testing import Grid, InProcessProxy, linear_model, make_contexts

# --- the client's local steps against lines 5-6 --------------------------------------


def test_local_steps_match_a_float64_reference():
    """Line 5 by SGD, line 6 after it, from a kept g_k, clipping and decay on.

    L = mean squared error of a linear model (full batch); per step
    g = clip(∇L(θ)) + λθ, then θ ← θ − η(g − g_k + α(θ − θ^{t−1}));
    after K steps g_k⁺ = g_k − α(θ_K − θ^{t−1}). All in float64 NumPy.
    """
    rng = np.random.default_rng(3)
    x_in, t = rng.normal(size=(12, 4)), rng.normal(size=(12, 1))
    w0, b0 = rng.normal(size=(1, 4)), rng.normal(size=(1,))
    g_k = {"weight": rng.normal(size=(1, 4)), "bias": rng.normal(size=(1,))}
    alpha, lr, steps, clip, wd = 0.3, 0.05, 4, 0.5, 0.1
    model = linear_model(w0, b0)
    data = TensorDataset(torch.from_numpy(x_in), torch.from_numpy(t))
    client = FedDynClient()
    client.begin(
        LocalStart(model, {wire.LOCAL_UPDATE: "feddyn", "feddyn.alpha": alpha}, {},
                   dict(g_k), data, nn.MSELoss(), 12, torch.device("cpu"), 1, lr)
    )  # fmt: skip
    result = train_local(
        model, torch.optim.SGD(model.parameters(), lr=lr), nn.MSELoss(), data,
        epochs=0, steps=steps, batch_size=12, seed=0, device=torch.device("cpu"),
        classification=False, weight_decay=wd, grad_clip=clip, local_update=client,
    )  # fmt: skip
    end = client.end(model, result.steps)

    start = {"weight": w0, "bias": b0}
    theta = {k: v.copy() for k, v in start.items()}
    scales = []
    for _ in range(steps):
        residual = x_in @ theta["weight"].T + theta["bias"] - t
        grad = {
            "weight": 2 / len(x_in) * residual.T @ x_in,
            "bias": 2 / len(x_in) * residual.sum(axis=0),
        }
        norm = np.sqrt(sum(np.sum(g**2) for g in grad.values()))
        scales.append(min(1.0, clip / (norm + 1e-6)))  # torch's clip_grad_norm_
        for k in theta:
            g = grad[k] * scales[-1] + wd * theta[k]
            theta[k] = theta[k] - lr * (g - g_k[k] + alpha * (theta[k] - start[k]))
    for k in theta:
        got = getattr(model, k).detach().numpy()
        np.testing.assert_allclose(got, theta[k], rtol=1e-12)
        kept = g_k[k] - alpha * (theta[k] - start[k])
        np.testing.assert_allclose(end.state[k], kept, rtol=1e-12)
    assert end.arrays == {} and end.metrics == {}  # the model only; no reset
    assert min(scales) < 1  # the clipping acted (the FedDyn terms unclipped)


def test_unusable_client_state_is_reset_to_zero():
    """A g_k of other shapes restarts from g_k = 0 and is reported."""
    model = linear_model(np.ones((1, 2)), np.zeros(1))
    data = TensorDataset(torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 1))
    client = FedDynClient()
    client.begin(
        LocalStart(model, {"feddyn.alpha": 0.1}, {}, {"weight": np.ones((3, 3))},
                   data, nn.MSELoss(), 2, torch.device("cpu"), 1, 0.1)
    )  # fmt: skip
    end = client.end(model, 0)  # no step taken: g_k⁺ = 0 − α·0
    assert end.metrics == {wire.LOCAL_STATE_RESET: 1.0}
    assert all(np.all(v == 0) for v in end.state.values())


# --- rounds: both halves against Algorithm 1 ------------------------------------------

LINREG = {"task": "synthetic-linreg", "local-steps": 3, "batch-size": 30}

#: the reference below averages the two sampled updates as they are: the
#: projection (two clients that disagree) and the pull cap off
PLAIN_MEAN = {"project_opposing": False, "max_contribution_ratio": 0.0}


def _linreg_clients(num: int) -> list[tuple[np.ndarray, np.ndarray]]:
    cfg = validate_run_config(LINREG)
    task = TASKS.get("synthetic-linreg")
    data = []
    for pid in range(num):
        tensors = task.load_client(cfg, pid, num).train.tensors
        data.append(tuple(a.double().numpy() for a in tensors))
    return data


class Reference:
    """Algorithm 1 in float64: server θ and h, every client's g_k, m clients."""

    def __init__(self, theta: np.ndarray, m: int, alpha: float, lr: float) -> None:
        self.theta, self.h = theta, np.zeros_like(theta)
        self.g = [np.zeros_like(theta) for _ in range(m)]
        self.m, self.alpha, self.lr = m, alpha, lr

    def round(self, sampled, data, steps):
        """One round with participants ``sampled`` (client indices)."""
        trained = []
        for k in sampled:
            inputs, targets = data[k]
            w = self.theta.copy()
            for _ in range(steps):  # (1/2n)‖Xw − t‖²: ∇ = Xᵀ(Xw − t)/n
                grad = (inputs @ w[0] - targets) @ inputs / len(inputs)
                full = grad[None, :] - self.g[k] + self.alpha * (w - self.theta)
                w = w - self.lr * full
            self.g[k] = self.g[k] - self.alpha * (w - self.theta)  # line 6
            trained.append(w)
        change = sum(w - self.theta for w in trained)
        self.h = self.h - self.alpha / self.m * change  # line 8
        self.theta = sum(trained) / len(trained) - self.h / self.alpha  # line 9


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("api", ["message", "legacy"])
def test_rounds_with_partial_participation_match_a_float64_reference(api):
    """Four rounds, 2 of m = 3 nodes each, in either API: lines 5-9.

    The reference keeps θ, h and each g_k in float64; the sampled set of each
    round is read from the messages the strategy sent. h/α moves θ away from
    the mean only because |P_t| < m and the g_k differ (checked at the end).
    """
    num, alpha, lr, steps = 3, 0.5, 0.1, LINREG["local-steps"]
    data = _linreg_clients(num)
    contexts = make_contexts(num, LINREG)
    torch.manual_seed(0)
    state = TASKS.get("synthetic-linreg").build_model().state_dict()
    key = "linear.weight"
    reference = Reference(state[key].double().numpy(), num, alpha, lr)
    if api == "message":
        strategy = FedDyn(alpha=alpha, fraction_train=0.5, min_train_nodes=2,
                          min_available_nodes=num, **PLAIN_MEAN)  # fmt: skip
        arrays = ArrayRecord(state)
    else:
        manager = SimpleClientManager()
        for context in contexts.values():
            manager.register(InProcessProxy(context))
        strategy = LegacyFedDyn(
            alpha=alpha, array_names=list(state), fraction_fit=0.5,
            min_fit_clients=2, min_available_clients=num,
            on_fit_config_fn=lambda r: {wire.LR: lr, wire.SERVER_ROUND: r},
            **PLAIN_MEAN,
        )  # fmt: skip
        parameters = ndarrays_to_parameters([v.numpy() for v in state.values()])
    for server_round in (1, 2, 3, 4):
        if api == "message":
            messages = list(
                strategy.configure_train(
                    server_round, arrays, ConfigRecord({wire.LR: lr}),
                    Grid(list(contexts)),
                )
            )  # fmt: skip
            sampled = [m.metadata.dst_node_id - 1 for m in messages]
            replies = [
                client_app.train(m, contexts[m.metadata.dst_node_id]) for m in messages
            ]
            new, _ = strategy.aggregate_train(server_round, replies)
            assert new is not None
            arrays = new
            got = arrays.to_torch_state_dict()[key].numpy()
        else:
            pairs = strategy.configure_fit(server_round, parameters, manager)
            sampled = [proxy.context.node_id - 1 for proxy, _ in pairs]
            results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
            new_parameters, _ = strategy.aggregate_fit(server_round, results, [])
            assert new_parameters is not None
            parameters = new_parameters
            got = parameters_to_ndarrays(parameters)[0]
        assert len(sampled) == 2
        reference.round(sampled, data, steps)
        np.testing.assert_allclose(got, reference.theta, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(
            strategy.rule.h[key], reference.h, rtol=1e-4, atol=1e-7
        )
        diagnostics = strategy.round_reports[server_round]["diagnostics"]
        assert diagnostics["feddyn-participation"] == pytest.approx(2 / 3)
    # not vacuous: the correction moved θ off the participants' mean
    assert np.abs(reference.h).max() / alpha > 1e-3


def test_rule_matches_lines_8_9_and_resumes_from_its_state():
    """``rule.step`` with m given, against the closed form; then a copy
    restored from ``state_dict`` takes the same next step."""
    rng = np.random.default_rng(0)
    x = {"w": rng.normal(size=5)}
    clients = [{"w": x["w"] + rng.normal(size=5)} for _ in range(2)]
    rule = FedDynRule(alpha=0.2)
    new, diagnostics = rule.step(x, clients, [1.0, 7.0], num_nodes=5)
    mean = (clients[0]["w"] + clients[1]["w"]) / 2  # uniform: num-examples unused
    h = -0.2 / 5 * sum(c["w"] - x["w"] for c in clients)
    np.testing.assert_allclose(rule.h["w"], h, rtol=1e-14)
    np.testing.assert_allclose(new["w"], mean - h / 0.2, rtol=1e-14)
    assert diagnostics["feddyn-participation"] == pytest.approx(0.4)
    copy = FedDynRule(alpha=0.2)
    copy.load_state_dict(rule.state_dict())
    again = [{"w": new["w"] + rng.normal(size=5)} for _ in range(3)]
    want, _ = rule.step(new, again, [1.0] * 3, num_nodes=5)
    got, _ = copy.step(new, again, [1.0] * 3, num_nodes=5)
    np.testing.assert_array_equal(got["w"], want["w"])
    # m unknown: full participation, h/α = −Δ̄, so θ = x + 2Δ̄
    alone = FedDynRule(alpha=0.2)
    full, _ = alone.step(x, clients, [1.0, 1.0])
    np.testing.assert_allclose(full["w"], mean + (mean - x["w"]), rtol=1e-14)


# --- the declaration: both halves from one α, the run config ---------------------


def test_both_halves_share_alpha_in_both_apis_and_the_run_config(cfg):
    """One declared α reaches the rule and the clients, whichever way built."""
    for strategy in (FedDyn(alpha=0.2), LegacyFedDyn(alpha=0.2)):
        assert strategy.rule.alpha == strategy.local_update.alpha == 0.2
    built = build_strategy(cfg(strategy="feddyn", **{"feddyn.alpha": 0.2}), 4)
    assert isinstance(built.local_update, FedDynLocal)
    assert built.rule.alpha == built.local_update.alpha == 0.2
    scalars, arrays = built.local_update.configure(1, {}, 4)
    assert scalars == {"feddyn.alpha": 0.2} and arrays == {}
    # with another local update: both run, combined on the wire
    both = FedDyn(local_update=FedProx(mu=0.1))
    assert isinstance(both.local_update, LocalUpdates)
    assert both.local_update.name == "feddyn+fedprox"
    with pytest.raises(ValueError, match="alpha"):
        FedDyn(alpha=0.0)
    with pytest.raises(ConfigError, match="feddyn.alpha"):
        cfg(strategy="feddyn", **{"feddyn.alpha": -1.0})
    # FedDyn's clients send only their update and its rule steps on Δ̄ (and
    # uniformly): it runs under SecAgg+, with SCAFFOLD's mean beside it too
    assert cfg(strategy="feddyn", secure_aggregation="secagg+")["strategy"] == "feddyn"
    both = cfg(strategy="feddyn", secure_aggregation="secagg+", local_update="scaffold")
    assert both["local-update"] == "scaffold"
