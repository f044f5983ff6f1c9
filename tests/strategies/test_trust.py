"""Issue #17: a client's reported ‖Δ_i‖² must not steer the server step.

Oracles are written out here, one round from a fresh state, in float64:
FedExP (arXiv 2301.09604, η = max(1, A / (2(‖Δ̄‖² + ε)))), FedDuAdagrad /
FedDuAdam (DUA Alg. 1 lines 12-17, first round: v, s, m from zero) and
FedExPM (FedDuAdam with G = I: our definition of the FedDuA §5.1 baseline,
which the paper does not define). Clipping is done by hand.
"""

from __future__ import annotations

import json
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

from fedadapt import strategies as ours
from fedadapt.strategies import legacy
from fedadapt.strategies.adapter import FederationFailedError
from tests.helpers import NO_DEFENCE, make_reply

pytestmark = pytest.mark.usefixtures("task_identity")

SHAPES = {"w": (8, 6), "b": (6,)}
NUM_CLIENTS = 5
EPS = 1e-3  # FedExP's ε (default)


def _setup(seed=0, scale=0.05):
    """Global arrays and clients with independent updates (A ≈ 5‖Δ̄‖², η > 1)."""
    rng = np.random.default_rng(seed)
    x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    clients = [
        {k: (x + scale * rng.normal(size=x.shape)).astype(np.float32)
         for k, x in x0.items()}
        for _ in range(NUM_CLIENTS)
    ]  # fmt: skip
    return x0, clients


def _deltas(x0, clients):
    return [{k: c[k].astype(np.float64) - x0[k] for k in x0} for c in clients]


def _sq(delta):
    return float(sum(np.sum(d**2) for d in delta.values()))


def _true_norms(x0, clients):
    return [_sq(d) for d in _deltas(x0, clients)]


def oracle(name, x0, deltas, norms):
    """One first-round step of ``name`` from Δ_i and the norms it is given."""
    mean = {k: sum(d[k] for d in deltas) / len(deltas) for k in x0}
    a = sum(norms) / len(norms)
    if name == "fedexp":
        eta = max(1.0, a / (2 * (_sq(mean) + EPS)))
        return {k: x0[k] + eta * mean[k] for k in x0}
    if name == "fedexpm":  # FedDuAdam, G = I, ε_g = ε, β = 0.9
        v = {k: 0.1 * m for k, m in mean.items()}
        eta = 0.1 * a / 2 / (_sq(v) + EPS)
        return {k: x0[k] + eta * v[k] for k in x0}
    b1, b2 = (0.0, 0.0) if name == "feddua-adagrad" else (0.9, 0.99)
    v = {k: (1 - b1) * m for k, m in mean.items()}
    s = {k: (1 - b2) * m**2 for k, m in mean.items()}
    g = {k: np.sqrt(s[k]) + 1e-9 for k in x0}
    q = sum(float(np.sum(v[k] ** 2 / g[k])) for k in x0)
    eta = (1 - b1) * a / 2 / q
    return {k: x0[k] + eta * v[k] / g[k] for k in x0}


def build(name, api="message", **kwargs):
    """The strategy ``name``, returning the iterate w_1 (the step under test)."""
    kwargs = {"average_last_two": False, **NO_DEFENCE, **kwargs}
    module = ours if api == "message" else legacy
    if name.startswith("feddua"):
        return module.FedDuA(variant=name.split("-")[1], **kwargs)
    return module.FedExP(server_momentum=0.9 if name == "fedexpm" else 0.0, **kwargs)


def _grid(num_nodes=NUM_CLIENTS):
    grid = Mock(spec=Grid)
    grid.get_node_ids.return_value = list(range(1, num_nodes + 1))
    return grid


def _record(arrays):
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _message_round(strategy, x0, clients, norms):
    list(strategy.configure_train(1, _record(x0), ConfigRecord(), _grid()))
    replies = [
        make_reply(c, {"num-examples": 10, "update-sq-norm": n}, node_id=i + 1)
        for i, (c, n) in enumerate(zip(clients, norms, strict=True))
    ]
    new, _ = strategy.aggregate_train(1, replies)
    return {k: v.numpy() for k, v in new.items()}, strategy.round_reports[1]


def _proxy(cid):
    proxy = Mock(spec=ClientProxy)
    proxy.cid = cid
    return proxy


def _legacy_round(strategy, x0, clients, norms, names=None):
    manager = Mock(spec=ClientManager)
    proxies = [_proxy(str(i)) for i in range(len(clients))]
    manager.num_available.return_value = len(proxies)
    manager.sample.return_value = proxies
    keys = names or list(x0)
    strategy.configure_fit(1, ndarrays_to_parameters([x0[k] for k in keys]), manager)
    results = [
        (p, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([c[k] for k in keys]),
                   10, {"update-sq-norm": n}))
        for p, c, n in zip(proxies, clients, norms, strict=True)
    ]  # fmt: skip
    new, metrics = strategy.aggregate_fit(1, results, [])
    from flwr.common import parameters_to_ndarrays

    return dict(zip(keys, parameters_to_ndarrays(new), strict=True)), metrics


NAMES = ["feddua-adam", "feddua-adagrad", "fedexp", "fedexpm"]


@pytest.mark.parametrize("factor", [1e6, 0.0])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("api", ["message", "legacy"])
def test_a_lying_client_does_not_change_the_step(api, name, factor):
    # Prepare: client 2 reports its true norm times 1e6 (or 0)
    x0, clients = _setup()
    true = _true_norms(x0, clients)
    reported = list(true)
    reported[2] *= factor
    want = oracle(name, x0, _deltas(x0, clients), true)
    lied = oracle(name, x0, _deltas(x0, clients), reported)
    assert max(np.max(np.abs(lied[k] - want[k])) for k in x0) > 1e-3  # it matters
    # Execute
    strategy = build(name, api)
    if api == "message":
        got, report = _message_round(strategy, x0, clients, reported)
    else:
        got, _ = _legacy_round(strategy, x0, clients, reported)
        report = strategy.round_reports[1]
    # Assert: the step of the true norms; the lie counted, the reply used
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert report["train_replies"]["norm_mismatches"] == 1
    assert report["train_replies"]["used"] == NUM_CLIENTS
    assert report["diagnostics"]["norms-trusted"] == 0.0


def test_mismatch_is_logged_with_both_values(caplog):
    x0, clients = _setup()
    reported = _true_norms(x0, clients)
    reported[0] = 1e9
    _message_round(build("fedexp"), x0, clients, reported)
    assert "reported update-sq-norm = 1e+09 but its arrays give" in caplog.text


def test_float32_rounding_of_an_honest_norm_is_no_mismatch():
    x0, clients = _setup()
    reported = [n * (1 + 2e-5) for n in _true_norms(x0, clients)]
    _, report = _message_round(build("feddua-adam"), x0, clients, reported)
    assert report["train_replies"]["norm_mismatches"] == 0


def test_secure_aggregation_mode_uses_the_reported_norms():
    # Prepare: the liar of the test above, but the server is told to trust
    x0, clients = _setup()
    reported = _true_norms(x0, clients)
    reported[2] *= 1e6
    want = oracle("fedexp", x0, _deltas(x0, clients), reported)
    # Execute
    got, report = _message_round(
        build("fedexp", secure_aggregation=True), x0, clients, reported
    )
    # Assert: trusted as given (nothing to check it against)
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5)
    assert report["diagnostics"]["norms-trusted"] == 1.0
    assert report["train_replies"]["norm_mismatches"] == 0


def _clipped(deltas, c):
    out = []
    for d in deltas:
        norm = np.sqrt(_sq(d))
        out.append({k: v * min(1.0, c / norm) for k, v in d.items()})
    return out


@pytest.mark.parametrize("name", ["fedexp", "feddua-adam"])
def test_max_update_norm_clips_updates_before_the_sums(name):
    # Prepare: client 0 moved 20x further than the others; clip at 0.5
    x0, clients = _setup(seed=3)
    clients[0] = {k: x0[k] + 20 * (v - x0[k]) for k, v in clients[0].items()}
    deltas = _deltas(x0, clients)
    clip = 0.5
    assert np.sqrt(_sq(deltas[0])) > clip > max(np.sqrt(_sq(d)) for d in deltas[1:])
    clipped = _clipped(deltas, clip)
    want = oracle(name, x0, clipped, [_sq(d) for d in clipped])
    # Execute: the absolute bound alone (the default relative one would
    # scale client 0 to the median norm: tests/strategies/test_hostile.py)
    strategy = build(name, max_update_norm=clip, max_update_norm_ratio=0.0)
    got, report = _message_round(strategy, x0, clients, _true_norms(x0, clients))
    # Assert
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6)
    assert report["train_replies"]["clipped"] == 1
    assert report["train_replies"]["norm_mismatches"] == 0  # checked before clipping


def test_clipping_applies_to_plain_averaging_too():
    x0, clients = _setup(seed=4)
    deltas = _clipped(_deltas(x0, clients), 0.1)
    want = {k: x0[k] + sum(d[k] for d in deltas) / NUM_CLIENTS for k in x0}
    strategy = ours.FedAvg(
        max_update_norm=0.1, max_contribution_ratio=0.0, project_opposing=False
    )
    got, report = _message_round(strategy, x0, clients, _true_norms(x0, clients))
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert report["train_replies"]["clipped"] == NUM_CLIENTS


def test_feddua_composes_with_flowers_server_side_dp_clipping():
    # Prepare: Flower's own wrapper clips x_i − x_t to 0.3 (no noise, for an
    # exact oracle); clients report their unclipped norms
    x0, clients = _setup(seed=5, scale=0.2)
    clip = 0.3
    deltas = _deltas(x0, clients)
    assert all(np.sqrt(_sq(d)) > clip for d in deltas)
    clipped = _clipped(deltas, clip)
    want = oracle("feddua-adam", x0, clipped, [_sq(d) for d in clipped])
    inner = ours.FedDuA(average_last_two=False, **NO_DEFENCE)  # the bare w_1
    dp = DifferentialPrivacyServerSideFixedClipping(
        inner, noise_multiplier=0.0, clipping_norm=clip, num_sampled_clients=5
    )
    # Execute
    list(dp.configure_train(1, _record(x0), ConfigRecord(), _grid()))
    replies = [
        make_reply(c, {"num-examples": 10, "update-sq-norm": n}, node_id=i + 1)
        for i, (c, n) in enumerate(zip(clients, _true_norms(x0, clients), strict=True))
    ]
    new, _ = dp.aggregate_train(1, replies)
    # Assert: FedDuA stepped on the clipped updates and their clipped norms
    for k in x0:
        np.testing.assert_allclose(new[k].numpy(), want[k], rtol=1e-4, atol=1e-6)
    assert inner.round_reports[1]["train_replies"]["norm_mismatches"] == 5


def test_every_reply_failing_for_n_rounds_stops_with_the_clients_errors(caplog):
    x0, clients = _setup()
    strategy = ours.FedAvg(max_failed_rounds=2)
    failing = [make_reply(None, {}, node_id=1, error=True)]
    good = [make_reply(clients[0], {"num-examples": 1})]
    rounds = [failing, good, failing]  # a used reply resets the count
    for server_round, replies in enumerate(rounds, start=1):
        list(
            strategy.configure_train(server_round, _record(x0), ConfigRecord(), _grid())
        )
        strategy.aggregate_train(server_round, replies)
    list(strategy.configure_train(4, _record(x0), ConfigRecord(), _grid()))
    rejected = [make_reply({"w": x0["w"]}, {"num-examples": 1})]  # names differ
    with pytest.raises(FederationFailedError, match="2 consecutive rounds") as info:
        strategy.aggregate_train(4, failing + rejected)
    assert "client raised" in str(info.value) and "names differ" in str(info.value)
    assert "client raised" in caplog.text


def test_max_failed_rounds_zero_never_stops():
    x0, _ = _setup()
    strategy = ours.FedExP(max_failed_rounds=0)
    for server_round in range(1, 6):
        list(
            strategy.configure_train(server_round, _record(x0), ConfigRecord(), _grid())
        )
        failing = [make_reply(None, {}, error=True)]
        assert strategy.aggregate_train(server_round, failing) == (None, None)


def test_legacy_strategy_stops_after_failed_rounds_too():
    strategy = legacy.FedDuA(max_failed_rounds=1)
    with pytest.raises(FederationFailedError, match="boom"):
        strategy.aggregate_fit(1, [], [RuntimeError("boom")])


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"max_update_norm": -1.0}, "max_update_norm"),
        ({"max_failed_rounds": 1.5}, "max_failed_rounds"),
        ({"max_failed_rounds": -1}, "max_failed_rounds"),
        ({"secure_aggregation": True, "max_update_norm": 1.0}, "secure_aggregation"),
    ],
)
def test_invalid_trust_options_raise(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ours.FedDuA(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        legacy.FedExP(**kwargs)


def test_run_config_keys_reach_both_apis_strategies():
    from fedadapt.config import validate_run_config
    from fedadapt.server.strategy_factory import build_strategy

    cfg = validate_run_config(
        {"strategy": "feddua", "max-update-norm": 2.0, "max-failed-rounds": 5,
         "clients-per-round": 2}
    )  # fmt: skip
    for strategy in (build_strategy(cfg, 4), build_strategy(cfg, api="legacy")):
        assert strategy.max_update_norm == 2.0 and strategy.max_failed_rounds == 5
        assert strategy.secure_aggregation is False


@pytest.mark.app
def test_legacy_batchnorm_model_norms_agree_with_the_numpy_client(monkeypatch):
    """The legacy server and the NumPyClient compute ‖Δ_i‖² over the same arrays."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from fedadapt.client.numpy_client import FedAdaptClient
    from fedadapt.tasks import TASKS
    from fedadapt.tasks.base import ClientData, Task

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(),
                             nn.Linear(8, 3))  # fmt: skip

    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(64, 4, generator=gen) * 3 + 5,  # BN running stats move a lot
        torch.randint(0, 3, (64,), generator=gen),
    )
    task = Task("bn-test", "", model, lambda cfg, i, n: ClientData(data, data),
                lambda cfg: data)  # fmt: skip
    monkeypatch.setattr(TASKS, "get", lambda name: task)
    names = list(model().state_dict())
    x0 = {k: v.numpy() for k, v in model().state_dict().items()}
    node = {"partition-id": 0, "num-partitions": 2}
    replies = []
    for lr in (0.05, 0.1):
        client = FedAdaptClient({"local-epochs": 1, "client-lr": lr}, node)
        arrays, n, metrics = client.fit([x0[k] for k in names], {"lr": lr})
        replies.append((dict(zip(names, arrays, strict=True)), n, metrics))
    # the client's norm covers the parameters only, not the BN buffers
    param_keys = [k for k in names if "running" not in k and "num_batches" not in k]
    for arrays, _, metrics in replies:
        want = sum(float(np.sum((arrays[k].astype(np.float64) - x0[k]) ** 2))
                   for k in param_keys)  # fmt: skip
        np.testing.assert_allclose(metrics["update-sq-norm"], want, rtol=1e-6)
    clients = [r[0] for r in replies]
    norms = [r[2]["update-sq-norm"] for r in replies]

    strategy = legacy.FedExP(array_names=names, average_last_two=False)
    got, _ = _legacy_round(strategy, x0, clients, norms, names=names)
    report = strategy.round_reports[1]
    assert report["train_replies"]["norm_mismatches"] == 0
    diagnostics = report["diagnostics"]
    assert diagnostics["mean-client-sq-norm"] >= diagnostics["mean-update-sq-norm"]
    # oracle: FedExP on the parameters, BN buffers plainly averaged
    deltas = _deltas(x0, clients)
    params = {k: x0[k] for k in param_keys}
    step = oracle("fedexp", params, [{k: d[k] for k in params} for d in deltas], norms)
    for k in names:
        if k in step:
            np.testing.assert_allclose(got[k], step[k], rtol=1e-5, atol=1e-7)
        else:
            mean = x0[k] + sum(d[k] for d in deltas) / 2
            np.testing.assert_allclose(got[k], mean.astype(x0[k].dtype), rtol=1e-5)


@pytest.mark.app
def test_legacy_app_names_the_arrays(tmp_path):
    from flwr.common import Context, RecordDict

    from fedadapt.server import legacy_app

    cfg = {"output-dir": str(tmp_path), "run-name": "names", "strategy": "fedexp"}
    context = Context(1, 0, {}, RecordDict(), cfg)
    strategy = legacy_app.server_fn(context).server.strategy
    assert strategy.array_names == list(
        legacy_app.initial_state(
            legacy_app.TASKS.get("digits-mlp"), legacy_app.validate_run_config(cfg)
        )
    )
    legacy_app._RUNS.pop(1)


@pytest.mark.app
def test_server_app_run_fails_after_failed_rounds(tmp_path):
    """In-process simulation: every client raises; the run stops, status failed."""
    from tests.helpers import run_in_process

    def broken_train(msg, context):
        raise RuntimeError("disk on fire")

    with pytest.raises(Exception):  # noqa: B017 (Flower re-raises in its own way)
        run_in_process(
            {"output-dir": str(tmp_path), "run-name": "broken",
             "num-server-rounds": 6, "clients-per-round": 2, "max-failed-rounds": 2},
            num_supernodes=2, client_train=broken_train,
        )  # fmt: skip
    data = json.loads((tmp_path / "broken" / "results.json").read_text())
    assert data["status"] == "failed"
    assert "2 consecutive rounds" in data["error"]
    assert "disk on fire" in data["error"]
    assert len(data["rounds"]) == 1  # round 1 recorded; round 2 stopped the run


@pytest.mark.app
def test_legacy_app_records_the_error_that_ended_the_run(tmp_path):
    from flwr.common import Context, RecordDict

    from fedadapt.server import legacy_app

    cfg = {"output-dir": str(tmp_path), "run-name": "stopped", "strategy": "fedexp"}
    context = Context(7, 0, {}, RecordDict(), cfg)
    strategy = legacy_app.server_fn(context).server.strategy  # registers the run
    strategy.max_failed_rounds = 1

    def fails_in_round_one(_context):  # the run's loop, as far as it gets
        strategy.aggregate_fit(1, [], [RuntimeError("disk on fire")])

    with pytest.raises(FederationFailedError):
        legacy_app.run(None, context, fails_in_round_one)  # type: ignore[arg-type]
    data = json.loads((tmp_path / "stopped" / "results.json").read_text())
    assert data["status"] == "failed" and "disk on fire" in data["error"]
