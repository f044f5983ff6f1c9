"""The local-update hook (#28 item 4): both halves, client state; FedProx."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager
from torch import nn
from torch.utils.data import TensorDataset

from fedadapt.client.fedprox import FedProxClient
from fedadapt.client.local import train_round
from fedadapt.client.local_update import (
    CLIENT_UPDATES,
    ClientUpdate,
    LocalEnd,
    LocalStart,
)
from fedadapt.client.training import train_local
from fedadapt.config import validate_run_config
from fedadapt.strategies import FedAvg, FedProx, LocalUpdate, wire
from fedadapt.strategies.legacy import FedAvg as LegacyFedAvg
from fedadapt.tasks import TASKS
from tests.client.harness import (
    RUN_CONFIG,
    InProcessProxy,
    global_state,
    linear_model,
    make_contexts,
    message_rounds,
)
from tests.helpers import ROOT, run_in_process

# --- FedProx against its algorithm box -----------------------------------------------


def test_fedprox_local_steps_match_a_float64_reference():
    """Li et al. 2020, Alg. 2 line 5 with SGD as the local solver, step by step.

    h(w) = F(w) + (μ/2)‖w − w_t‖², F = mean squared error of a linear model;
    each step w ← w − η(∇F(w) + μ(w − w_t)), written here with NumPy.
    """
    rng = np.random.default_rng(0)
    x, t = rng.normal(size=(12, 4)), rng.normal(size=(12, 1))
    w0, b0 = rng.normal(size=(1, 4)), rng.normal(size=(1,))
    mu, lr, steps = 0.7, 0.05, 4
    model = linear_model(w0, b0)
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(t))
    prox = FedProxClient()
    prox.begin(
        LocalStart(model, {"fedprox.mu": mu}, {}, None, data, nn.MSELoss(), 12,
                   torch.device("cpu"), 1, lr)
    )  # fmt: skip
    train_local(
        model, torch.optim.SGD(model.parameters(), lr=lr), nn.MSELoss(), data,
        epochs=0, steps=steps, batch_size=12, seed=0, device=torch.device("cpu"),
        classification=False, local_update=prox,
    )  # fmt: skip
    w, b = w0.copy(), b0.copy()
    for _ in range(steps):  # one full batch per step: the order does not matter
        residual = x @ w.T + b - t  # (12, 1)
        grad_w = 2 / len(x) * residual.T @ x + mu * (w - w0)
        grad_b = 2 / len(x) * residual.sum(axis=0) + mu * (b - b0)
        w, b = w - lr * grad_w, b - lr * grad_b
    np.testing.assert_allclose(model.weight.detach().numpy(), w, rtol=1e-12)
    np.testing.assert_allclose(model.bias.detach().numpy(), b, rtol=1e-12)
    assert not np.allclose(w, w0 - 0)  # the reference moved


def _cfg(**overrides: Any) -> dict[str, Any]:
    base = {"task": "digits-mlp", "local-steps": 4, "batch-size": 16}
    return validate_run_config({**base, **overrides})


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", 0.1), ("delta-sgd", 0.2)])
def test_fedprox_mu_zero_trains_as_the_plain_client_bit_for_bit(optimizer, lr):
    """μ = 0 changes nothing (Δ-SGD re-evaluates the objective: both passes)."""
    cfg = _cfg(**{"client-optimizer": optimizer})
    state = global_state()

    def run(config: dict[str, Any] | None):
        return train_round(cfg, 0, 3, state, lr=lr, server_round=1, config=config)

    plain = run(None)
    zero = run({wire.LOCAL_UPDATE: "fedprox", "fedprox.mu": 0.0})
    prox = run({wire.LOCAL_UPDATE: "fedprox", "fedprox.mu": 1.0})
    for key, value in plain.state.items():
        assert torch.equal(zero.state[key], value), key
    clocks = (wire.TRAIN_TIME_S, wire.PROCESS_AGE_S)  # differ run to run
    timing = ("fedprox-term", *clocks)
    assert {k: v for k, v in zero.metrics.items() if k not in timing} == {
        k: v for k, v in plain.metrics.items() if k not in clocks
    }
    # not vacuous: μ > 0 trains another model, pulled towards w_t
    moved = lambda r: sum(  # noqa: E731
        float(torch.sum((r.state[k] - state[k]) ** 2)) for k in state
    )
    assert 0 < moved(prox) < moved(plain)
    assert prox.metrics["fedprox-term"] > 0


# --- a stateful local update, through both APIs by hand ---------------------------


class Counter(LocalUpdate):
    """Server half of a test algorithm: sends the round, sums the clients' counts."""

    name: ClassVar[str] = "counter"

    def __init__(self) -> None:
        self.total = 0.0

    def configure(self, server_round, model, num_nodes):
        return {"counter.nodes": num_nodes}, {"offset": np.array([server_round] * 2)}

    def check_reply(self, arrays, metrics):
        if arrays is None or set(arrays) != {"count"}:
            return "expected the array 'count'"
        return None

    def aggregate(self, replies, weights):
        self.total += float(sum(r["count"][0] for r in replies))
        return {"counter-total": self.total}

    def _state(self):
        return {"total": self.total}

    def _load(self, state):
        self.total = state["total"]


class CounterClient(ClientUpdate):
    """Client half: counts its rounds in its client state; echoes what arrived."""

    name: ClassVar[str] = "counter"

    def begin(self, start: LocalStart) -> None:
        self.count = 1 if start.state is None else int(start.state["count"]) + 1
        self.offset = float(start.arrays["offset"][0])
        self.nodes = start.config["counter.nodes"]

    def check_state(self, state):
        return None if isinstance(state.get("count"), int) else "no count"

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        return LocalEnd(
            arrays={"count": np.array([self.count], dtype=np.int64)},
            metrics={"count": self.count, "offset": self.offset, "nodes": self.nodes},
            state={"count": self.count},
        )


@pytest.fixture
def counter(monkeypatch):
    monkeypatch.setitem(CLIENT_UPDATES._items, "counter", CounterClient)


@pytest.mark.usefixtures("task_identity", "counter")
def test_message_api_client_state_survives_rounds_and_arrays_travel_both_ways():
    contexts = make_contexts(2)
    strategy = FedAvg(local_update=Counter(), fraction_train=1.0, min_train_nodes=2,
                      min_available_nodes=2)  # fmt: skip
    reports = message_rounds(strategy, contexts, 3)
    for server_round, (metrics, report) in enumerate(reports, start=1):
        assert report["train_replies"]["used"] == 2
        assert metrics["count"] == server_round  # kept in Context.state
        assert metrics["offset"] == server_round  # the server's array arrived
        assert metrics["nodes"] == 2  # the server's scalar arrived
    # the clients' arrays reached the server half: 2 × (1 + 2 + 3)
    assert reports[-1][1]["diagnostics"]["counter-total"] == 12
    # the server half's state is in both state formats
    assert strategy.state_dict()["local_update"] == {"total": 12.0}
    again = FedAvg(local_update=Counter())
    again.load_state_records(strategy.state_to_records())
    assert again.local_update.total == 12.0


@pytest.mark.usefixtures("task_identity", "counter")
def test_corrupt_client_state_is_reset_logged_and_counted(caplog):
    contexts = make_contexts(2)
    strategy = FedAvg(local_update=Counter(), min_train_nodes=2, min_available_nodes=2)
    message_rounds(strategy, contexts, 2)
    broken = contexts[1].state  # node 1's state, as a restart could leave it
    broken["local-update.counter.layout"] = ConfigRecord({"layout": "{", "format": 1})
    contexts[2].state["local-update.counter.values"] = ConfigRecord({"count": "two"})
    (metrics, report), = message_rounds(strategy, contexts, 1)  # fmt: skip
    assert report["train_replies"]["used"] == 2  # no crash, no rejection
    assert metrics[wire.LOCAL_STATE_RESET] == 1  # both reset (weighted mean of 1s)
    assert metrics["count"] == 1  # started afresh
    assert "client state reset" in caplog.text


@pytest.mark.usefixtures("task_identity", "counter")
def test_bad_local_update_replies_are_rejected_and_counted():
    contexts = make_contexts(2)
    strategy = FedAvg(local_update=Counter(), min_train_nodes=2, min_available_nodes=2)

    def drop_one(replies):
        del replies[0].content[wire.LOCAL_ARRAYS]

    (_, report), = message_rounds(strategy, contexts, 1, drop_one)  # fmt: skip
    assert report["train_replies"]["used"] == 1
    assert report["train_replies"]["rejected"] == 1
    assert (
        "counter: expected the array 'count'"
        in report["train_replies"]["rejections"][0]
    )

    # arrays from a client when no local update runs are refused, not ignored
    def add_arrays(replies):
        replies[0].content[wire.LOCAL_ARRAYS] = ArrayRecord({"x": Array(np.zeros(2))})

    plain = FedAvg(min_train_nodes=2, min_available_nodes=2)
    (_, report), = message_rounds(plain, make_contexts(2), 1, add_arrays)  # fmt: skip
    assert report["train_replies"]["rejected"] == 1
    assert "no local update runs" in report["train_replies"]["rejections"][0]


@pytest.mark.usefixtures("counter")
def test_legacy_api_client_state_survives_rounds_and_arrays_travel_both_ways():
    manager = SimpleClientManager()
    proxies = [InProcessProxy(c) for c in make_contexts(2).values()]
    for proxy in proxies:
        manager.register(proxy)
    state = global_state()
    keys = list(state)
    strategy = LegacyFedAvg(
        local_update=Counter(), array_names=keys, min_fit_clients=2,
        min_available_clients=2, on_fit_config_fn=lambda r: {wire.LR: 0.1},
        fit_metrics_aggregation_fn=lambda pairs: {
            k: sum(m[k] for _, m in pairs) / len(pairs)
            for k in ("count", "offset", "nodes")
        },
    )  # fmt: skip
    parameters = ndarrays_to_parameters([v.numpy() for v in state.values()])
    for server_round in (1, 2, 3):
        pairs = strategy.configure_fit(server_round, parameters, manager)
        assert json.loads(pairs[0][1].config[wire.LOCAL_ARRAYS]) == ["offset"]
        results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
        assert all(r.status.code == Code.OK for _, r in results)
        new, metrics = strategy.aggregate_fit(server_round, results, [])
        assert new is not None
        parameters = new
        assert metrics["count"] == server_round
        assert metrics["offset"] == server_round
        assert metrics["nodes"] == 2
        assert len(new.tensors) == len(keys)  # the model only, local arrays split off
    assert strategy.round_reports[3]["diagnostics"]["counter-total"] == 12
    # a reply whose named local arrays are missing is rejected, not misread
    res = results[0][1]
    names = json.dumps(["count", "x"])
    short = FitRes(Status(Code.OK, ""), res.parameters, res.num_examples,
                   {**res.metrics, wire.LOCAL_ARRAYS: names})  # fmt: skip
    strategy.configure_fit(4, parameters, manager)
    strategy.aggregate_fit(4, [(results[0][0], short), results[1]], [])
    assert strategy.round_reports[4]["train_replies"]["rejected"] == 1


# --- end to end through Flower -------------------------------------------------------


@pytest.mark.e2e
def test_fedprox_run_in_flower_simulation(tmp_path):
    """local-update=fedprox: Flower carries μ to the clients, results.json says so."""
    run_in_process(
        {
            "output-dir": str(tmp_path), "run-name": "prox", "num-server-rounds": 2,
            "local-update": "fedprox", "fedprox.mu": 0.1, "local-steps": 5,
        },
        num_supernodes=2,
    )  # fmt: skip
    data = json.loads((tmp_path / "prox" / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["local_update"] == {"name": "fedprox", "mu": 0.1}
    for r in data["rounds"]:
        assert r["replies"]["used"] == 2
        assert r["train"]["fedprox-term"] > 0  # the client half ran
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]


def test_fedprox_server_half_checks_mu_and_is_picked_by_run_config():
    from fedadapt.server.strategy_factory import build_strategy

    with pytest.raises(ValueError, match=r"Invalid mu: -1.0 \(must be in \[0, inf\]\)"):
        FedProx(mu=-1.0)
    strategy = build_strategy(_cfg(**{"local-update": "fedprox", "fedprox.mu": 0.3}), 2)
    assert isinstance(strategy.local_update, FedProx)
    assert strategy.local_update.mu == 0.3
    assert build_strategy(_cfg(), 2).local_update is None
    legacy = build_strategy(_cfg(**{"local-update": "fedprox"}), api="legacy")
    assert legacy.local_update.mu == 0.01


# --- the README's recipe, as written ---------------------------------------------


def _readme_recipe(tmp_path, monkeypatch):
    """Write the README's two code blocks as modules and import them."""
    import importlib
    import re
    import sys

    from fedadapt.strategies.local_update import LOCAL_UPDATES

    section = (
        (ROOT / "README.md")
        .read_text()
        .split("### Adding an algorithm with a client-side part", 1)[1]
    )
    blocks = re.findall(r"```python\n(# (\w+)\.py: .*?)```", section, re.S)
    assert [name for _, name in blocks] == ["my_scaffold_server", "my_scaffold_client"]
    for code, name in blocks:
        (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    for registry in (CLIENT_UPDATES, LOCAL_UPDATES):  # registrations end with the test
        monkeypatch.setattr(registry, "_items", dict(registry._items))
    for _, name in blocks:
        monkeypatch.delitem(sys.modules, name, raising=False)
    server = importlib.import_module("my_scaffold_server")
    importlib.import_module("my_scaffold_client")
    return server.MyScaffold


@pytest.mark.usefixtures("task_identity")
def test_readme_recipe_runs_as_written_scaffold_control_variates(tmp_path, monkeypatch):
    """SCAFFOLD option II: after round 1, c = mean_i (x − y_i)/(K η_l) (c, c_i = 0
    before: plain SGD steps); with every node in every round c stays the mean
    of the clients' kept c_i (Karimireddy et al. 2020, Alg. 1 lines 12-17)."""
    from fedadapt.strategies._records import state_from_records

    scaffold = _readme_recipe(tmp_path, monkeypatch)
    contexts = make_contexts(2)
    strategy = FedAvg(local_update=scaffold(), min_train_nodes=2,
                      min_available_nodes=2)  # fmt: skip
    x = {k: v.numpy() for k, v in global_state().items()}
    sent: list = []
    message_rounds(strategy, contexts, 1, sent.extend)
    steps, lr = RUN_CONFIG["local-steps"], 0.1
    for name, c in strategy.local_update.c.items():
        y = [r.content[wire.ARRAYS][name].numpy() for r in sent]
        expected = sum((x[name] - y_i) / (steps * lr) for y_i in y) / len(y)
        np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-6)
    x2 = strategy.training_arrays.to_torch_state_dict()
    sent.clear()
    message_rounds(strategy, contexts, 1, sent.extend, first=2)  # c ≠ c_i now
    kept = [state_from_records(c.state, "local-update.my-scaffold")
            for c in contexts.values()]  # fmt: skip
    for name, c in strategy.local_update.c.items():
        np.testing.assert_allclose(c, (kept[0][name] + kept[1][name]) / 2,
                                   rtol=1e-4, atol=1e-6)  # fmt: skip
    # the gradient correction acted: plain SGD from the same x and seed differs
    plain = train_round(validate_run_config(RUN_CONFIG), 0, 2, x2, lr=lr,
                        server_round=2)  # fmt: skip
    node_1 = next(r for r in sent if r.metadata.src_node_id == 1)
    assert not np.allclose(node_1.content[wire.ARRAYS]["net.1.weight"].numpy(),
                           plain.state["net.1.weight"].numpy())  # fmt: skip
    model = TASKS.get("digits-mlp").build_model()
    assert set(strategy.state_dict()["local_update"]["c"]) == {
        n for n, _ in model.named_parameters()
    }


def test_fedprox_client_refuses_a_train_config_without_mu():
    cfg, state = _cfg(), global_state()
    with pytest.raises(ValueError, match="fedprox.mu must be a number >= 0, got None"):
        train_round(cfg, 0, 3, state, lr=0.1, server_round=1,
                    config={wire.LOCAL_UPDATE: "fedprox"})  # fmt: skip


def test_process_age_counts_from_the_process_start() -> None:
    """process-age-s (clients.jsonl's start-up split) against a known sleep."""
    import subprocess
    import sys

    code = (
        "import time; time.sleep(1.0); "
        "from fedadapt.client.worker import process_age_s; print(process_age_s())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    # the sleep plus the interpreter and the import
    assert 1.0 <= float(out) < 120.0
