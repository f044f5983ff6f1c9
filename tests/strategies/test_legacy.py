"""Legacy-API strategies: equivalence with flwr.server.strategy and screening."""

from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import strategy as flower_legacy
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from fedadapt.strategies import legacy
from tests.helpers import NO_DEFENCE

SHAPES = [(6, 4), (4,), (3, 6)]


def _manager(proxies):
    manager = Mock(spec=ClientManager)
    manager.num_available.return_value = len(proxies)
    manager.sample.return_value = proxies
    return manager


def _proxy(cid):
    proxy = Mock(spec=ClientProxy)
    proxy.cid = cid
    return proxy


def _fit_res(arrays, n, **metrics):
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)


def _run(strategy, x0, rounds, seed):
    rng = np.random.default_rng(seed)
    proxies = [_proxy(str(i)) for i in range(3)]
    params = ndarrays_to_parameters(x0)
    for server_round in range(1, rounds + 1):
        strategy.configure_fit(server_round, params, _manager(proxies))
        current = parameters_to_ndarrays(params)
        results = [
            (p, _fit_res([(a + 0.05 * rng.normal(size=a.shape)).astype(np.float32)
                          for a in current], int(n)))
            for p, n in zip(proxies, rng.integers(1, 50, size=3), strict=True)
        ]  # fmt: skip
        new, _ = strategy.aggregate_fit(server_round, results, [])
        params = new if new is not None else params
    return parameters_to_ndarrays(params)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("FedAvg", {}),
        ("FedAvgM", {"server_learning_rate": 0.5, "server_momentum": 0.9}),
        ("FedAdam", {}),
        ("FedAdagrad", {}),
        ("FedYogi", {}),
    ],
)
def test_legacy_drop_in_equivalence(name, kwargs):
    """Legacy drop-in (τ = 1e-9 for FedAdam/FedAdagrad): same arrays as Flower's."""
    rng = np.random.default_rng(0)
    x0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    kwargs = {**kwargs, "initial_parameters": ndarrays_to_parameters(x0)}
    got = _run(getattr(legacy, name)(**{**NO_DEFENCE, **kwargs}), x0, rounds=4, seed=1)
    want = _run(getattr(flower_legacy, name)(**kwargs), x0, rounds=4, seed=1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)


def test_legacy_feddua_screens_and_reports():
    x0 = [np.zeros(3, np.float32)]
    strategy = legacy.FedDuA(epsilon=0.0)
    proxies = [_proxy("a"), _proxy("b"), _proxy("c")]
    strategy.configure_fit(1, ndarrays_to_parameters(x0), _manager(proxies))
    results = [
        (proxies[0], _fit_res([np.array([1.0, 2.0, 0.5], np.float32)], 3)),
        (proxies[1], _fit_res([np.array([3.0, 0.0, 0.5], np.float32)], 1)),
        (proxies[2], _fit_res([np.array([np.nan, 0, 0], np.float32)], 1)),
    ]
    params, metrics = strategy.aggregate_fit(1, results, [RuntimeError("lost")])
    a = (1 + 4 + 0.25 + 9 + 0 + 0.25) / 2  # uniform mean of ‖Δ_i‖² (paper)
    w1 = a / (2 * 3.5) * np.ones(3)
    report = strategy.round_reports[1]["train_replies"]
    assert (report["received"], report["failed"], report["rejected"]) == (4, 1, 1)
    assert metrics["strategy-server-lr"] > 0
    # returned (evaluated, final) model: (w_0 + w_1)/2; next round trains from w_1
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], w1 / 2, rtol=1e-6)
    pairs = strategy.configure_fit(2, params, _manager(proxies))
    sent = parameters_to_ndarrays(pairs[0][1].parameters)[0]
    np.testing.assert_allclose(sent, w1, rtol=1e-6)


def test_legacy_round_without_valid_results_keeps_the_model():
    strategy = legacy.FedExP()
    strategy.configure_fit(1, ndarrays_to_parameters([np.zeros(2, np.float32)]),
                           _manager([_proxy("a")]))  # fmt: skip
    bad = [(_proxy("a"), _fit_res([np.zeros(3, np.float32)], 2))]  # wrong shape
    assert strategy.aggregate_fit(1, bad, []) == (None, {})
