"""Fed-LAMB's v̂/v exchange on the local-update hook, alone and with FedProx.

The strategy ``fed-lamb`` carries its own client-side part (the server half
:class:`SecondMoments`, the client half :class:`SecondMomentsClient`); a
user's local update runs beside it (:class:`LocalUpdates`). The Fed-LAMB
arithmetic itself is tested against its algorithm box in
test_fedlamb_optim.py (client) and test_second_moments.py /
test_fedlamb_strategy.py (server); here: that the hook carries it unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.server.client_manager import SimpleClientManager
from torch import nn

from fedadapt.client.fedlamb import SecondMomentsClient
from fedadapt.client.fedprox import FedProxClient
from fedadapt.client.local import client_seed, train_round
from fedadapt.client.local_update import LocalStart
from fedadapt.client.training import train_local
from fedadapt.config import validate_run_config
from fedadapt.optimizers import OPTIMIZERS
from fedadapt.server.strategy_factory import build_strategy
from fedadapt.strategies import FedLAMB, FedProx, wire
from fedadapt.strategies import legacy as legacy_strategies
from fedadapt.strategies.fedlamb import SecondMoments, aggregate_second_moments
from fedadapt.strategies.local_update import LocalUpdates
from fedadapt.tasks import TASKS
from tests.client.harness import (
    InProcessProxy,
    global_state,
    make_contexts,
    message_rounds,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Single-threaded, so two runs of the same round are equal bit for bit.

    Under load (``make test`` on 2 busy cores) a multi-threaded run and its
    by-hand twin once differed in the last bit of ``net.1.weight``: the
    summation order of a threaded reduction is not fixed.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


RUN_CONFIG = {
    "task": "digits-mlp", "local-steps": 3, "batch-size": 16,
    "strategy": "fed-lamb", "client-optimizer": "fed-lamb", "client-lr": 0.01,
    "local-update": "fedprox", "fedprox.mu": 0.5,
}  # fmt: skip


def test_fed_lamb_runs_its_second_moments_by_default_and_beside_a_given_one():
    """No key selects the exchange: FedLAMB (both APIs, the app) always runs it."""
    for cls in (FedLAMB, legacy_strategies.FedLAMB):
        own = cls(eps=1e-6, weighting="num_examples").local_update
        assert isinstance(own, SecondMoments)
        assert (own.eps, own.weighting) == (1e-6, "num_examples")
        both = cls(local_update=FedProx(mu=0.5)).local_update
        assert isinstance(both, LocalUpdates) and both.name == "fed-lamb+fedprox"
    assert both.describe() == {
        "name": "fed-lamb+fedprox", "fed-lamb.eps": 1e-8,
        "fed-lamb.weighting": "uniform", "fed-lamb.max_moment_ratio": 4.0,
        "fedprox.mu": 0.5,
    }  # fmt: skip
    cfg = validate_run_config(RUN_CONFIG)
    app = build_strategy(cfg, num_nodes=3)
    assert app.local_update.name == "fed-lamb+fedprox"
    assert app.local_update.updates[1].mu == 0.5
    alone = {k: v for k, v in RUN_CONFIG.items() if not k.startswith("fedprox")}
    alone["local-update"] = "none"
    legacy = build_strategy(validate_run_config(alone), api="legacy")
    assert isinstance(legacy.local_update, SecondMoments)
    plain = validate_run_config({**RUN_CONFIG, "strategy": "fedavg",
                                 "client-optimizer": "sgd"})  # fmt: skip
    assert isinstance(build_strategy(plain, num_nodes=3).local_update, FedProx)


def test_client_round_with_fed_lamb_and_fedprox_matches_a_by_hand_round():
    """The combined client halves do what the optimizer and FedProx do by hand:
    the optimizer starts from the server's v̂, every loss gains the proximal
    term, and the optimizer's v goes back keyed ``fed-lamb/<parameter>``."""
    cfg = validate_run_config(RUN_CONFIG)
    state = global_state()
    model = TASKS.get("digits-mlp").build_model()
    names = [n for n, _ in model.named_parameters()]
    rng = np.random.default_rng(0)
    v_hat = {
        n: rng.uniform(0, 1e-3, size=p.shape).astype(np.float32)
        for n, p in model.named_parameters()
    }
    config = {wire.LOCAL_UPDATE: "fed-lamb+fedprox", "fedprox.mu": 0.5}
    arrays = {f"fed-lamb/{n}": v for n, v in v_hat.items()}
    result = train_round(cfg, 0, 3, state, lr=0.01, server_round=2, config=config,
                         local_arrays=arrays)  # fmt: skip

    # by hand: the same model, data, optimizer and seed, no hook plumbing
    task = TASKS.get("digits-mlp")
    data = task.load_client(cfg, 0, 3)
    model.load_state_dict(state)
    optimizer = OPTIMIZERS.get("fed-lamb")(model, 0.01, cfg)
    optimizer.load_second_moments([torch.as_tensor(v_hat[n]) for n in names])
    prox = FedProxClient()
    prox.begin(
        LocalStart(model, config, {}, None, data.train, task.criterion(), 16,
                   torch.device("cpu"), 2, 0.01)
    )  # fmt: skip
    train_local(
        model, optimizer, task.criterion(), data.train, epochs=0, steps=3,
        batch_size=16, seed=client_seed(cfg, 2, 0), device=torch.device("cpu"),
        local_update=prox,
    )  # fmt: skip
    for key, value in model.state_dict().items():
        assert torch.equal(result.state[key], value), key
    assert result.local_arrays is not None
    assert list(result.local_arrays) == [f"fed-lamb/{n}" for n in names]
    for n, v in zip(names, optimizer.second_moments(), strict=True):
        np.testing.assert_array_equal(result.local_arrays[f"fed-lamb/{n}"], v.numpy())
    assert result.metrics["fedprox-term"] > 0
    # not vacuous: without v̂ (round 1, v̂_0 = ε·1) the client trains otherwise
    first = train_round(cfg, 0, 3, state, lr=0.01, server_round=2, config=config)
    assert not torch.equal(first.state[names[0]], result.state[names[0]])


@pytest.mark.usefixtures("task_identity")
def test_both_apis_carry_v_hat_and_v_alike_with_fedprox_beside():
    """Two rounds strategy ↔ fedadapt's clients: v̂ = max(v̂, mean v) of the
    clients' replies, and the legacy API ends with the same model and v̂."""
    message = FedLAMB(local_update=FedProx(mu=0.5), min_train_nodes=2,
                      min_available_nodes=2)  # fmt: skip

    def v_hat_sent_from_round_2(server_round, messages):
        sent = messages[0].content.array_records.get(wire.LOCAL_ARRAYS)
        assert (sent is None) == (server_round == 1)  # v̂ from round 2 on

    replied = []
    reports = message_rounds(
        message, make_contexts(2, RUN_CONFIG), 2, replied.append, lr=0.01,
        messages_hook=v_hat_sent_from_round_2,
    )  # fmt: skip
    assert all(report["train_replies"]["used"] == 2 for _, report in reports)
    model, replies = message.latest_arrays, replied[-1]
    v_hat = message.local_update.updates[0].v_hat
    # round 2's v̂ from the replies, by hand (uniform ω, Alg. 1 line 16)
    assert v_hat is not None
    v = [
        {k.split("/", 1)[1]: a.numpy() for k, a in r.content[wire.LOCAL_ARRAYS].items()}
        for r in replies
    ]
    mean = {n: (v[0][n].astype(np.float64) + v[1][n]) / 2 for n in v[0]}
    for n, value in v_hat.items():
        assert np.all(value >= mean[n].astype(np.float32))

    manager = SimpleClientManager()
    for context in make_contexts(2, RUN_CONFIG).values():
        manager.register(InProcessProxy(context))
    state = global_state()
    legacy = legacy_strategies.FedLAMB(
        local_update=FedProx(mu=0.5), array_names=list(state), min_fit_clients=2,
        min_available_clients=2,
        on_fit_config_fn=lambda r: {wire.LR: 0.01, wire.SERVER_ROUND: r},
    )  # fmt: skip
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

    parameters = ndarrays_to_parameters([t.numpy() for t in state.values()])
    for server_round in (1, 2):
        pairs = legacy.configure_fit(server_round, parameters, manager)
        results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
        parameters, _ = legacy.aggregate_fit(server_round, results, [])
        assert legacy.round_reports[server_round]["train_replies"]["used"] == 2
    for got, key in zip(parameters_to_ndarrays(parameters), state, strict=True):
        np.testing.assert_array_equal(got, model[key].numpy())
    legacy_v_hat = legacy.local_update.updates[0].v_hat
    assert set(legacy_v_hat) == set(v_hat)
    for n, value in v_hat.items():
        np.testing.assert_array_equal(legacy_v_hat[n], value)


def test_combined_state_survives_a_checkpoint_round_trip():
    """v̂ inside a combined local update goes into the strategy's records."""
    strategy = FedLAMB(local_update=FedProx(mu=0.5))
    own = strategy.local_update.updates[0]
    own.v_hat = {"w": np.array([0.25, 0.5], np.float32)}
    restored = FedLAMB(local_update=FedProx(mu=0.5))
    restored.load_state_records(strategy.state_to_records())
    np.testing.assert_array_equal(restored.local_update.updates[0].v_hat["w"],
                                  [0.25, 0.5])  # fmt: skip


@pytest.mark.parametrize(
    ("local", "reason"),
    [
        ({"fedprox/x": np.ones(2, np.float32)}, "fed-lamb: no second moments"),
        ({"w": np.ones(2, np.float32)}, "array 'w' names none of fed-lamb+fedprox"),
        ({"fed-lamb/w": np.full(2, -1.0, np.float32)}, "fed-lamb: second moment"),
    ],
)
def test_combined_replies_are_screened_by_each_member(local, reason):
    strategy = FedLAMB(local_update=FedProx(mu=0.5))
    combined = strategy.local_update
    combined.configure(1, {"w": np.zeros(2, np.float32)}, 1)
    assert reason in combined.check_reply(local, {})
    assert combined.check_reply({"fed-lamb/w": np.ones(2, np.float32)}, {}) is None


def test_client_half_refuses_an_optimizer_without_second_moments():
    model = nn.Linear(2, 1)
    start: Any = LocalStart(model, {}, {}, None, [], nn.MSELoss(), 1,
                            torch.device("cpu"), 1, 0.1,
                            torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    with pytest.raises(ValueError, match="client-optimizer"):
        SecondMomentsClient().begin(start)
    lamb = OPTIMIZERS.get("fed-lamb")(model, 0.1, validate_run_config(RUN_CONFIG))
    start.optimizer = lamb
    start.arrays = {"weight": np.ones((1, 2), np.float32)}
    with pytest.raises(ValueError, match="lacks parameter 'bias'"):
        SecondMomentsClient().begin(start)


def test_aggregated_v_hat_equals_the_rule_of_algorithm_1():
    """The server half's v̂ is aggregate_second_moments over the used replies
    with the strategy's weighting (uniform by default)."""
    half = SecondMoments()
    half.configure(1, {"w": np.zeros(2, np.float32)}, 2)
    replies = [{"w": np.array([1.0, 4.0], np.float32)},
               {"w": np.array([3.0, 0.0], np.float32)}]  # fmt: skip
    assert all(half.check_reply(r, {}) is None for r in replies)
    half.aggregate(replies, [1.0, 3.0])
    np.testing.assert_array_equal(half.v_hat["w"], [2.0, 2.0])  # uniform mean
    weighted = SecondMoments(weighting="num_examples")
    weighted.aggregate(replies, [1.0, 3.0])
    np.testing.assert_allclose(weighted.v_hat["w"], [2.5, 1.0])
    again = aggregate_second_moments(weighted.v_hat, [{"w": np.zeros(2, np.float32)}])
    np.testing.assert_array_equal(again["w"], weighted.v_hat["w"])  # never decreases


# a Ray simulation of ~40 s: with make test-deploy (CI runs it), to keep
# the default suite within CI's 20 minutes; unit references cover the algorithm
@pytest.mark.deploy
@pytest.mark.e2e
def test_fed_lamb_with_fedprox_runs_in_flower_simulation(tmp_path):
    """Flower carries v̂, v and μ (serialised records, ``<name>/<key>`` arrays)."""
    import json

    from tests.helpers import run_in_process

    cfg = {k: v for k, v in RUN_CONFIG.items() if k != "task"}
    run_in_process(
        {"output-dir": str(tmp_path), "run-name": "lamb", "num-server-rounds": 2,
         **cfg},
        num_supernodes=2,
    )  # fmt: skip
    data = json.loads((tmp_path / "lamb" / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["local_update"]["name"] == "fed-lamb+fedprox"
    for r in data["rounds"]:
        assert r["replies"]["used"] == 2
        assert r["train"]["fedprox-term"] > 0  # FedProx's half ran
        assert r["strategy"]["v-hat-mean"] > 0  # the clients' v reached v̂
