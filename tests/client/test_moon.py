"""MOON (Li, He and Song, CVPR 2021) on the local-update hook (#29).

The references are written from Algorithm 1 and eq. 3-4 of the paper, not
from ``fedadapt.client.moon``: ℓ = CE + μ·ℓ_con with
ℓ_con = −log(e^{sim(z,z_glob)/τ} / (e^{sim(z,z_glob)/τ} + e^{sim(z,z_prev)/τ})),
sim the cosine, z_prev of the client's model after its previous
participation (the global model at its first one).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.common import Code, ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager
from torch import nn
from torch.utils.data import TensorDataset

from fedadapt.client.local import train_round
from fedadapt.client.local_update import LocalStart, save_client_state
from fedadapt.client.moon import MoonClient
from fedadapt.client.training import train_local
from fedadapt.config import validate_run_config
from fedadapt.strategies import FedAvg, Moon, wire
from fedadapt.strategies._records import state_from_records, state_to_records
from fedadapt.strategies.legacy import FedAvg as LegacyFedAvg
from fedadapt.tasks import TASKS
from fedadapt.tasks.models import MLP, representation, representation_layer
from tests.client.harness import (
    InProcessProxy,
    global_state,
    make_contexts,
    message_rounds,
)
from tests.helpers import run_in_process
from tests.tasks.test_models import CASES

MOON = {wire.LOCAL_UPDATE: "moon", "moon.mu": 1.0, "moon.temperature": 0.5}
STATE = "local-update.moon"  # the records of MOON's client state in Context.state

# --- the algorithm box, step by step in float64 ------------------------------------


def _reference_round(w, prev, x, y, mu, tau, lr, steps):
    """K full-batch SGD steps on CE + μ·ℓ_con of a 1-hidden-layer ReLU MLP.

    ``w`` = (W1, b1, W2, b2) the global model, ``prev`` this client's previous
    model (or None: the global one). z = ReLU(W1 x + b1), the input of the
    last linear layer. Autograd only differentiates the formulas written here.
    """

    def hidden(p, inputs):
        return torch.relu(inputs @ p[0].T + p[1])

    def cosine(a, b):
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))

    frozen_global = [t.clone() for t in w]
    frozen_prev = frozen_global if prev is None else [t.clone() for t in prev]
    z_glob, z_prev = hidden(frozen_global, x), hidden(frozen_prev, x)
    w = [t.clone().requires_grad_(True) for t in w]
    for _ in range(steps):
        z = hidden(w, x)
        logits = z @ w[2].T + w[3]
        ce = -(logits.gather(1, y[:, None]).squeeze(1) - logits.logsumexp(1)).mean()
        pos = torch.exp(cosine(z, z_glob) / tau)
        neg = torch.exp(cosine(z, z_prev) / tau)
        con = -torch.log(pos / (pos + neg)).mean()
        grads = torch.autograd.grad(ce + mu * con, w)
        w = [
            (t - lr * g).detach().requires_grad_()
            for t, g in zip(w, grads, strict=True)
        ]
    return [t.detach() for t in w]


def _as_params(model: MLP) -> list[torch.Tensor]:
    net = model.net
    return [net[1].weight, net[1].bias, net[3].weight, net[3].bias]


def test_moon_rounds_match_a_float64_reference_of_algorithm_1():
    """Two clients, three FedAvg rounds, client 1 skips round 2.

    Round 1: z_prev = z_glob (no previous model: ℓ_con = log 2, no gradient);
    round 2: client 0's z_prev is its round-1 model; round 3: client 1's is
    still its round-1 model (its previous *participation*), kept as state,
    and client 0's is its round-2 model, which is also the global one.
    """
    torch.manual_seed(3)
    mu, tau, lr, steps = 0.8, 0.5, 0.3, 3
    data = [
        (torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 3, (10,)))
        for _ in range(2)
    ]
    model = MLP(5, 7, 3).double()
    ref = [p.detach().clone() for p in _as_params(model)]
    ref_prev: list[Any] = [None, None]
    states: list[Any] = [None, None]
    for participants in ([0, 1], [0], [0, 1]):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        local_code, local_ref = [], []
        for i in participants:
            x, y = data[i]
            client = MLP(5, 7, 3).double()
            client.load_state_dict(start)
            moon = MoonClient()
            moon.begin(
                LocalStart(client, {"moon.mu": mu, "moon.temperature": tau}, {},
                           states[i], TensorDataset(x, y), nn.CrossEntropyLoss(), 10,
                           torch.device("cpu"), 1, lr)
            )  # fmt: skip
            train_local(
                client, torch.optim.SGD(client.parameters(), lr=lr),
                nn.CrossEntropyLoss(), TensorDataset(x, y), epochs=0, steps=steps,
                batch_size=10, seed=0, device=torch.device("cpu"), local_update=moon,
            )  # fmt: skip
            states[i] = moon.end(client, steps).state
            trained = _reference_round(ref, ref_prev[i], x, y, mu, tau, lr, steps)
            for got, want in zip(_as_params(client), trained, strict=True):
                np.testing.assert_allclose(got.detach().numpy(), want.numpy(),
                                           rtol=1e-10, atol=1e-12)  # fmt: skip
            if ref_prev[i] is not None and not all(
                torch.equal(a, b) for a, b in zip(ref_prev[i], ref, strict=True)
            ):  # not vacuous: z_prev ≠ z_glob, and the term moved this client
                plain = _reference_round(ref, None, x, y, 0.0, tau, lr, steps)
                assert float((trained[0] - plain[0]).abs().max()) > 1e-2
            ref_prev[i] = trained
            local_code.append([p.detach().clone() for p in _as_params(client)])
            local_ref.append(trained)
        with torch.no_grad():  # FedAvg: the uniform mean of the local models
            means = [sum(v) / len(v) for v in zip(*local_code, strict=True)]
            for p, mean in zip(_as_params(model), means, strict=True):
                p.copy_(mean)
        ref = [sum(v) / len(v) for v in zip(*local_ref, strict=True)]
    for got, want in zip(_as_params(model), ref, strict=True):
        np.testing.assert_allclose(got.detach().numpy(), want.numpy(), rtol=1e-10,
                                   atol=1e-12)  # fmt: skip


# --- the representation of every task model -----------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_model_has_a_2d_representation_the_classifier_reads(name):
    """z = the input of the last Linear layer: (N, d), and that layer maps it to
    the logits (eval mode; ResNet-9 scales them, the linear model squeezes)."""
    factory, make_input, _ = CASES[name]
    torch.manual_seed(0)
    model = factory().eval()
    x = make_input()
    z, out = representation(model, x)
    layer = representation_layer(model)
    assert z.shape == (len(x), layer.in_features)
    scale = getattr(model, "output_scale", 1.0)
    torch.testing.assert_close(layer(z) * scale, out.reshape(len(x), -1))
    if hasattr(model, "features"):  # the ResNets: the Δ-SGD code's MOON output
        torch.testing.assert_close(z, model.features(x))
    if name == "linreg":  # no hidden layer: z is the input
        assert torch.equal(z, x)


def test_every_task_model_is_covered():
    covered = {type(factory()) for factory, _, _ in CASES.values()}
    for task in TASKS.names():
        model = TASKS.get(task).build_model()
        assert type(model) in covered, task
        representation_layer(model)  # defined
    with pytest.raises(ValueError, match="Conv2d has no nn.Linear layer"):
        representation_layer(nn.Conv2d(1, 1, 1))


# --- train_round: μ = 0, Δ-SGD, client state ---------------------------------------


def _cfg(**overrides: Any) -> dict[str, Any]:
    base = {"task": "digits-mlp", "local-steps": 4, "batch-size": 16}
    return validate_run_config({**base, **overrides})


def _previous_state(cfg, state) -> Any:
    """Records of a client that took part in round 1 (so z_prev ≠ z_glob)."""
    from flwr.app import RecordDict

    records = RecordDict()
    train_round(cfg, 0, 3, state, lr=0.1, server_round=1, config=MOON,
                client_state=records)  # fmt: skip
    return records


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", 0.1), ("delta-sgd", 0.2)])
def test_moon_mu_zero_trains_as_the_plain_client_bit_for_bit(optimizer, lr):
    """μ = 0 changes nothing, with a previous model (Δ-SGD: both passes)."""
    cfg = _cfg(**{"client-optimizer": optimizer})
    state = global_state()

    kept = _previous_state(cfg, state)

    def run(config):
        return train_round(cfg, 0, 3, state, lr=lr, server_round=2, config=config,
                           client_state=copy.deepcopy(kept))  # fmt: skip

    plain = run(None)
    zero = run({**MOON, "moon.mu": 0.0})
    moon = run(MOON)
    for key, value in plain.state.items():
        assert torch.equal(zero.state[key], value), key
    clocks = (wire.TRAIN_TIME_S, wire.PROCESS_AGE_S)  # differ run to run
    timing = ("moon-term", *clocks)
    assert {k: v for k, v in zero.metrics.items() if k not in timing} == {
        k: v for k, v in plain.metrics.items() if k not in clocks
    }
    assert zero.metrics["moon-term"] == 0.0
    # not vacuous: μ = 1 trains another model, with a term below log 2
    assert any(not torch.equal(moon.state[k], v) for k, v in plain.state.items())
    assert 0 < moon.metrics["moon-term"] < math.log(2)


def test_delta_sgd_second_pass_includes_the_term(monkeypatch):
    """Δ-SGD's same-batch mode re-evaluates the closure at x_{k−1}: the term is
    added there too, with the frozen models' z of the same batch."""
    calls: list[bool] = []
    original = MoonClient.loss_term

    def spy(self, model, inputs, targets, outputs):
        second = inputs is self._inputs  # True: a second pass on the batch
        term = original(self, model, inputs, targets, outputs)
        assert term is not None and term.requires_grad  # added to the objective
        calls.append(second)
        return term

    monkeypatch.setattr(MoonClient, "loss_term", spy)
    for optimizer, second_passes in (("sgd", 0), ("delta-sgd", 3)):
        calls.clear()
        cfg = _cfg(**{"client-optimizer": optimizer})
        train_round(cfg, 0, 3, global_state(), lr=0.2, server_round=1, config=MOON)
        assert calls.count(False) == 4  # one first pass per local step
        assert calls.count(True) == second_passes  # steps 2-4 re-evaluate


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda s: {"model": {k: v[..., :1] for k, v in s["model"].items()}},  # shapes
        lambda s: {"model": {k: v * np.nan for k, v in s["model"].items()}},  # NaN
        lambda s: {"model": dict(list(s["model"].items())[:1])},  # keys missing
        lambda s: {"weights": s["model"]},  # unknown layout
    ],
    ids=["shapes", "nan", "keys", "layout"],
)
def test_unusable_client_state_is_reset_to_the_global_model(corrupt, caplog):
    """Reset, logged and counted; the round trains as a first participation."""
    cfg, state = _cfg(), global_state()
    records = _previous_state(cfg, state)
    kept = state_from_records(records, STATE)
    save_client_state(records, MoonClient(), corrupt(kept))
    reset = train_round(cfg, 0, 3, state, lr=0.1, server_round=2, config=MOON,
                        client_state=records)  # fmt: skip
    first = train_round(cfg, 0, 3, state, lr=0.1, server_round=2, config=MOON)
    assert reset.metrics[wire.LOCAL_STATE_RESET] == 1
    assert "local update moon: client state reset" in caplog.text
    for key, value in first.state.items():
        assert torch.equal(reset.state[key], value), key
    # and the state kept now is the model just trained, usable next round
    again = state_from_records(records, STATE)["model"]
    assert all(np.array_equal(again[k], v.numpy()) for k, v in reset.state.items())


# --- both Flower APIs, by hand --------------------------------------------------


@pytest.mark.usefixtures("task_identity")
def test_message_api_keeps_each_nodes_trained_model_as_its_state():
    contexts = make_contexts(2)
    strategy = FedAvg(local_update=Moon(mu=1.0, temperature=0.5), min_train_nodes=2,
                      min_available_nodes=2)  # fmt: skip
    sent: list = []
    reports = message_rounds(strategy, contexts, 2, sent.extend)
    first, second = (metrics for metrics, _ in reports)
    assert first["moon-term"] == pytest.approx(math.log(2))  # z_prev = z_glob
    assert 0 < second["moon-term"] < math.log(2)  # z_prev: the round-1 model
    assert wire.LOCAL_STATE_RESET not in second
    for reply in sent[-2:]:  # round 2: each node keeps what it sent
        kept = state_from_records(contexts[reply.metadata.src_node_id].state, STATE)
        for key, array in reply.content[wire.ARRAYS].items():
            assert np.array_equal(kept["model"][key], array.numpy()), key
    # MOON's server half has no state; checkpoints carry it all the same
    again = FedAvg(local_update=Moon())
    again.load_state_records(strategy.state_to_records())
    assert strategy.state_dict()["local_update"] == {}


def test_legacy_api_runs_moon_with_client_state():
    manager = SimpleClientManager()
    contexts = make_contexts(2)
    for context in contexts.values():
        manager.register(InProcessProxy(context))
    state = global_state()
    strategy = LegacyFedAvg(
        local_update=Moon(), array_names=list(state), min_fit_clients=2,
        min_available_clients=2, on_fit_config_fn=lambda r: {wire.LR: 0.1},
        fit_metrics_aggregation_fn=lambda pairs: {
            "moon-term": sum(m["moon-term"] for _, m in pairs) / len(pairs)
        },
    )  # fmt: skip
    parameters = ndarrays_to_parameters([v.numpy() for v in state.values()])
    terms = []
    for server_round in (1, 2):
        pairs = strategy.configure_fit(server_round, parameters, manager)
        assert pairs[0][1].config["moon.temperature"] == 0.5
        results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
        assert all(r.status.code == Code.OK for _, r in results)
        parameters, metrics = strategy.aggregate_fit(server_round, results, [])
        terms.append(metrics["moon-term"])
    assert terms[0] == pytest.approx(math.log(2))
    assert 0 < terms[1] < math.log(2)  # the previous model came from Context.state
    assert all(f"{STATE}.layout" in c.state for c in contexts.values())


def test_moon_server_half_checks_its_parameters_and_is_picked_by_run_config():
    from fedadapt.server.strategy_factory import build_strategy

    with pytest.raises(ValueError, match=r"Invalid mu: -1.0"):
        Moon(mu=-1.0)
    with pytest.raises(ValueError, match=r"Invalid temperature: 0.0"):
        Moon(temperature=0.0)
    cfg = _cfg(**{"local-update": "moon", "moon.mu": 0.5, "moon.temperature": 0.2})
    update = build_strategy(cfg, 2).local_update
    assert isinstance(update, Moon)
    assert update.describe() == {"name": "moon", "mu": 0.5, "temperature": 0.2}
    assert update.configure(1, {}, 2) == ({"moon.mu": 0.5, "moon.temperature": 0.2}, {})
    legacy = build_strategy(_cfg(**{"local-update": "moon"}), api="legacy")
    assert (legacy.local_update.mu, legacy.local_update.temperature) == (1.0, 0.5)
    assert state_to_records(update.state_dict(), "x")  # an empty, storable state
    # a train config without the scalars is refused at the client, by name
    with pytest.raises(ValueError, match="moon.temperature must be a number"):
        train_round(_cfg(), 0, 3, global_state(), lr=0.1, server_round=1,
                    config={wire.LOCAL_UPDATE: "moon", "moon.mu": 1.0})  # fmt: skip


# --- end to end through Flower ---------------------------------------------------


# a Ray simulation of ~40 s: with make test-deploy (CI runs it), to keep
# the default suite within CI's 20 minutes; unit references cover the algorithm
@pytest.mark.deploy
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("strategy", "optimizer"),
    [("fedavg", "delta-sgd")],  # FedDuA + MOON: by hand, both APIs
)
def test_moon_runs_in_flower_simulation(tmp_path, strategy, optimizer):
    """local-update=moon with FedAvg + Δ-SGD clients and with FedDuA."""
    run_in_process(
        {
            "output-dir": str(tmp_path), "run-name": "moon", "num-server-rounds": 2,
            "strategy": strategy, "client-optimizer": optimizer,
            "local-update": "moon", "local-steps": 3, "client-lr": 0.2,
        },
        num_supernodes=2,
    )  # fmt: skip
    data = json.loads((tmp_path / "moon" / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["local_update"] == {"name": "moon", "mu": 1.0, "temperature": 0.5}
    first, second = data["rounds"]
    assert first["replies"]["used"] == second["replies"]["used"] == 2
    assert first["train"]["moon-term"] == pytest.approx(math.log(2))
    # round 2 contrasts with each node's round-1 model, kept by Flower
    assert 0 < second["train"]["moon-term"] < math.log(2)
    assert wire.LOCAL_STATE_RESET not in second["train"]
