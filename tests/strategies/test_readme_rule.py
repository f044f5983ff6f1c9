"""The README's "Your own server rule" example runs as written, in both adapters."""

from __future__ import annotations

import re
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common import parameters_to_ndarrays as to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp import Grid

from fedadapt.strategies.legacy import LegacyRuleStrategy
from tests.helpers import ROOT, make_reply

pytestmark = pytest.mark.usefixtures("task_identity")

X0 = {"w": np.array([1.0, -2.0, 0.5], np.float32), "b": np.zeros(2, np.float32)}
CLIENTS = [
    {
        "w": np.array([1.3, -2.0, 0.9], np.float32),
        "b": np.array([0.1, 0.0], np.float32),
    },
    {
        "w": np.array([0.9, -1.6, 0.5], np.float32),
        "b": np.array([0.3, -0.2], np.float32),
    },
]


def _readme_namespace() -> dict:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Your own server rule", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the README section lost its example"
    namespace: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    return namespace


def _expected(eta: float) -> dict[str, np.ndarray]:
    """x + η·Δ̄/‖Δ̄‖ with Δ̄ the uniform mean update, written out by hand."""
    mean = {k: (CLIENTS[0][k] + CLIENTS[1][k]) / 2 - X0[k] for k in X0}
    norm = np.sqrt(sum(np.sum(d.astype(np.float64) ** 2) for d in mean.values()))
    return {k: X0[k] + eta / norm * mean[k] for k in X0}


def _grid():
    grid = Mock(spec=Grid)
    grid.get_node_ids.return_value = [1, 2]
    return grid


def test_readme_rule_in_the_message_api_adapter():
    namespace = _readme_namespace()
    strategy = namespace["strategy"]  # RuleStrategy(NormalizedStep(eta=0.05), ...)
    arrays = ArrayRecord({k: Array(v) for k, v in X0.items()})
    list(strategy.configure_train(1, arrays, ConfigRecord(), _grid()))
    replies = [make_reply(c, {"num-examples": 10 * (i + 1)}, i + 1)
               for i, c in enumerate(CLIENTS)]  # fmt: skip
    new, _ = strategy.aggregate_train(1, replies)
    got = {k: v.numpy() for k, v in new.items()}
    for k, want in _expected(0.05).items():
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7)
    step = np.sqrt(sum(np.sum((got[k] - X0[k]) ** 2) for k in X0))
    assert abs(step - 0.05) < 1e-6
    assert strategy.round_reports[1]["diagnostics"]["server-lr"] > 0


def test_readme_rule_in_the_legacy_adapter():
    rule = _readme_namespace()["NormalizedStep"](eta=0.2)
    strategy = LegacyRuleStrategy(rule, array_names=list(X0))
    proxies = [Mock(spec=ClientProxy, cid=str(i)) for i in range(2)]
    manager = Mock(spec=ClientManager)
    manager.num_available.return_value = 2
    manager.sample.return_value = proxies
    strategy.configure_fit(1, ndarrays_to_parameters(list(X0.values())), manager)
    results = [
        (
            p,
            FitRes(
                Status(Code.OK, ""), ndarrays_to_parameters(list(c.values())), 5, {}
            ),
        )
        for p, c in zip(proxies, CLIENTS, strict=True)
    ]
    params, _ = strategy.aggregate_fit(1, results, [])
    got = dict(zip(X0, to_ndarrays(params), strict=True))
    for k, want in _expected(0.2).items():
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7)
