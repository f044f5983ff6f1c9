"""Issue #27 parts 5 and 7: what a Flower user plugging in a strategy meets.

Which arrays are trained (``trainable=``), replies without ``num-examples``
under uniform weighting, secure aggregation without norm reports, Flower's
summary line and the public import paths. Oracles are written out here in
float64, one round from a fresh state: FedExP (arXiv 2301.09604,
η = max(1, A / (2(‖Δ̄‖² + ε)))) and FedDuAdam (DUA Alg. 1 lines 12-17:
v, s, m from zero).
"""

from __future__ import annotations

import logging
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common import parameters_to_ndarrays as to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

import fedadapt.strategies as ours
from fedadapt.strategies import legacy
from tests.helpers import NO_DEFENCE, make_reply
from tests.strategies.test_trust import _grid, _record

pytestmark = pytest.mark.usefixtures("task_identity")

NUM_CLIENTS = 4
EPS = 1e-3  # FedExP's default ε


#: A model's state_dict as the server sees it: two parameters and a float
#: buffer that is not BatchNorm's (an EMA scale, registered with
#: ``register_buffer("running_scale", ...)``).
SHAPES = {"lin.weight": (3, 5), "lin.bias": (3,), "running_scale": (3,)}
PARAMS = ["lin.weight", "lin.bias"]


def _train(seed: int) -> tuple[dict[str, np.ndarray], float, dict[str, np.ndarray]]:
    """One client's round: move the parameters and the buffer.

    Returns the global arrays, the client's ``update-sq-norm`` computed the
    way a PyTorch user does (over ``model.parameters()``: not the buffer)
    and its arrays.
    """
    x0 = {k: np.random.default_rng(0).normal(size=s).astype(np.float32)
          for k, s in SHAPES.items()}  # fmt: skip
    x0["running_scale"] = np.ones(3, np.float32)
    rng = np.random.default_rng(seed + 1)
    new = {k: (x + 0.05 * rng.normal(size=x.shape)).astype(np.float32)
           for k, x in x0.items() if k in PARAMS}  # fmt: skip
    new["running_scale"] = (0.9 * x0["running_scale"] + 0.1 * (2 + seed)).astype(
        np.float32
    )  # an EMA update
    sq_norm = sum(float(np.sum((new[k] - x0[k]) ** 2)) for k in PARAMS)
    return x0, sq_norm, new


def _round_data():
    runs = [_train(seed) for seed in range(NUM_CLIENTS)]
    return runs[0][0], [r[2] for r in runs], [r[1] for r in runs]


def _oracle(name, x0, clients, trained, norms=None):
    """One first-round step on the ``trained`` arrays; the others averaged.

    A is the mean of ``norms`` when given (trusted reports), else of the
    true ‖Δ_i‖² over the trained arrays.
    """
    deltas = [{k: c[k].astype(np.float64) - x0[k] for k in x0} for c in clients]
    mean = {k: sum(d[k] for d in deltas) / len(deltas) for k in x0}
    if norms is None:
        norms = [sum(np.sum(d[k] ** 2) for k in trained) for d in deltas]
    a = np.mean(norms)
    sq_mean = sum(np.sum(mean[k] ** 2) for k in trained)
    out = {k: x0[k] + mean[k] for k in x0}
    if name == "fedexp":
        eta = max(1.0, a / (2 * (sq_mean + EPS)))
        out.update({k: x0[k] + eta * mean[k] for k in trained})
    else:  # FedDuAdam, β1 = 0.9, β2 = 0.99, ε = 1e-9, ε_g = 0
        v = {k: 0.1 * mean[k] for k in trained}
        g = {k: np.sqrt(0.01 * mean[k] ** 2) + 1e-9 for k in trained}
        q = sum(np.sum(v[k] ** 2 / g[k]) for k in trained)
        eta = 0.1 * a / 2 / q
        out.update({k: x0[k] + eta * v[k] / g[k] for k in trained})
    return out


def _message_round(strategy, x0, clients, metrics):
    list(strategy.configure_train(1, _record(x0), ConfigRecord(), _grid()))
    pairs = enumerate(zip(clients, metrics, strict=True))
    replies = [make_reply(c, m, node_id=i + 1) for i, (c, m) in pairs]
    new, train_metrics = strategy.aggregate_train(1, replies)
    got = None if new is None else {k: v.numpy() for k, v in new.items()}
    return got, train_metrics, strategy.round_reports[1]


def _legacy_round(strategy, x0, clients, metrics):
    names = list(x0)
    proxies = [Mock(spec=ClientProxy, cid=str(i)) for i in range(len(clients))]
    manager = Mock(spec=ClientManager)
    manager.num_available.return_value = len(proxies)
    manager.sample.return_value = proxies
    strategy.configure_fit(1, ndarrays_to_parameters([x0[k] for k in names]), manager)
    results = [
        (p, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([c[k] for k in names]),
                   10, m))
        for p, c, m in zip(proxies, clients, metrics, strict=True)
    ]  # fmt: skip
    new, _ = strategy.aggregate_fit(1, results, [])
    got = dict(zip(names, to_ndarrays(new), strict=True))
    return got, strategy.round_reports[1]


def _build(api, name, **kwargs):
    module = ours if api == "message" else legacy
    kwargs = {"average_last_two": False, **NO_DEFENCE, **kwargs}  # the bare step
    if api == "legacy":
        kwargs["array_names"] = list(SHAPES)
    return module.FedExP(**kwargs) if name == "fedexp" else module.FedDuA(**kwargs)


def _norm_metrics(norms):
    return [{"num-examples": 10, "update-sq-norm": n} for n in norms]


# --- part 5: which arrays are trained --------------------------------------------


@pytest.mark.parametrize(
    "trainable",
    [PARAMS, lambda name: not name.endswith("running_scale")],
    ids=["names", "predicate"],
)
@pytest.mark.parametrize("name", ["fedexp", "feddua"])
@pytest.mark.parametrize("api", ["message", "legacy"])
def test_trainable_keeps_a_non_batchnorm_buffer_out_of_the_rule(api, name, trainable):
    # Prepare: clients report ‖Δ_i‖² over model.parameters(), as PyTorch users do
    x0, clients, norms = _round_data()
    want = _oracle(name, x0, clients, PARAMS)
    strategy = _build(api, name, trainable=trainable)
    # Execute
    if api == "message":
        got, _, report = _message_round(strategy, x0, clients, _norm_metrics(norms))
    else:
        got, report = _legacy_round(strategy, x0, clients, _norm_metrics(norms))
    # Assert: no mismatch; the step over the parameters, the buffer averaged
    assert report["train_replies"]["norm_mismatches"] == 0
    assert report["train_replies"]["used"] == NUM_CLIENTS
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
    if name == "feddua":  # the preconditioner covers the trained arrays only
        assert set(strategy.rule.s) == set(PARAMS)


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_without_trainable_the_buffer_is_trained_and_every_norm_mismatches(api):
    """Today's default, kept: only BatchNorm buffers are recognised by name."""
    x0, clients, norms = _round_data()
    strategy = _build(api, "fedexp")
    if api == "message":
        got, _, report = _message_round(strategy, x0, clients, _norm_metrics(norms))
    else:
        got, report = _legacy_round(strategy, x0, clients, _norm_metrics(norms))
    assert report["train_replies"]["norm_mismatches"] == NUM_CLIENTS
    want = _oracle("fedexp", x0, clients, list(x0))
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_trainable_names_the_model_lacks_fail_before_any_training(api):
    x0, _, _ = _round_data()
    strategy = _build(api, "fedexp", trainable=["lin.weight", "lin.wieght"])
    with pytest.raises(ValueError, match="'lin.wieght'"):
        if api == "message":
            strategy.configure_train(1, _record(x0), ConfigRecord(), _grid())
        else:
            _legacy_round(strategy, x0, [], [])


def test_trainable_must_be_names_or_a_predicate():
    with pytest.raises(TypeError, match="collection of array names"):
        ours.FedDuA(trainable="lin.weight")
    with pytest.raises(TypeError, match="collection of array names"):
        legacy.FedAdam(trainable=3)


def test_trainable_applies_to_the_fedopt_family_too():
    """FedAdam puts every float array through Adam unless told otherwise."""
    x0, clients, norms = _round_data()
    strategy = ours.FedAdam(trainable=PARAMS, weighting="uniform")
    got, _, _ = _message_round(strategy, x0, clients, _norm_metrics(norms))
    mean = np.mean([c["running_scale"] for c in clients], axis=0)
    np.testing.assert_allclose(got["running_scale"], mean, rtol=1e-6)
    assert set(strategy.rule.v) == set(PARAMS)


def test_a_torch_module_with_a_registered_buffer():
    """The real thing: names from named_parameters(), norm over parameters()."""
    torch = pytest.importorskip("torch")

    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(5, 3)
            self.register_buffer("running_scale", torch.ones(3))

    torch.manual_seed(0)
    model = WithBuffer()
    x0 = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    clients, norms = [], []
    for seed in range(NUM_CLIENTS):
        model.load_state_dict({k: torch.from_numpy(v) for k, v in x0.items()})
        start = [p.detach().clone() for p in model.parameters()]
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p += 0.05 * torch.randn(p.shape, generator=gen)
            model.running_scale.mul_(0.9).add_(0.1 * (2 + seed))
        pairs = zip(model.parameters(), start, strict=True)
        norms.append(sum(float(((p.detach() - p0) ** 2).sum()) for p, p0 in pairs))
        clients.append({k: v.numpy().copy() for k, v in model.state_dict().items()})
    trained = [name for name, _ in model.named_parameters()]
    assert set(trained) == set(PARAMS) and "running_scale" in x0
    for trainable, mismatches in ((None, NUM_CLIENTS), (trained, 0)):
        strategy = ours.FedDuA(
            trainable=trainable, average_last_two=False, **NO_DEFENCE
        )
        got, _, report = _message_round(strategy, x0, clients, _norm_metrics(norms))
        assert report["train_replies"]["norm_mismatches"] == mismatches
    want = _oracle("feddua", x0, clients, trained)
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)


# --- part 7: what a plug-in user trips on --------------------------------------


@pytest.mark.parametrize("name", ["fedexp", "feddua"])
def test_uniform_weighting_accepts_replies_without_num_examples(name):
    # Prepare: Flower's quickstart-like replies without num-examples
    x0, clients, norms = _round_data()
    metrics = [{"train-loss": float(i)} for i in range(NUM_CLIENTS)]
    want = _oracle(name, x0, clients, list(x0))
    strategy = _build("message", name)
    # Execute
    got, train_metrics, report = _message_round(strategy, x0, clients, metrics)
    # Assert: every reply used with weight 1 (model and metrics alike)
    assert report["train_replies"]["used"] == NUM_CLIENTS
    assert report["train_replies"]["rejected"] == 0
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
    assert train_metrics["train-loss"] == pytest.approx(np.mean(range(NUM_CLIENTS)))


def test_num_examples_weighting_still_drops_replies_without_it():
    x0, clients, _ = _round_data()
    metrics = [{"num-examples": 5}, {}, {"num-examples": 5}, {"num-examples": 5}]
    strategy = ours.FedExP(weighting="num_examples")
    _, _, report = _message_round(strategy, x0, clients, metrics)
    assert report["train_replies"]["rejected"] == 1
    assert "num-examples" in report["train_replies"]["rejections"][0]


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_secure_aggregation_rejects_replies_without_a_norm(api, caplog):
    # Prepare: client 1 reports no update-sq-norm; the others report theirs
    x0, clients, norms = _round_data()
    metrics = _norm_metrics(norms)
    del metrics[1]["update-sq-norm"]
    kept = [c for i, c in enumerate(clients) if i != 1]
    # the reports cover the parameters only, the rule adapts the buffer too:
    # used as given all the same (a secure aggregator could not check them)
    reported = [n for i, n in enumerate(norms) if i != 1]
    want = _oracle("fedexp", x0, kept, list(x0), norms=reported)
    strategy = _build(api, "fedexp", secure_aggregation=True)
    # Execute
    if api == "message":
        got, _, report = _message_round(strategy, x0, clients, metrics)
    else:
        got, report = _legacy_round(strategy, x0, clients, metrics)
    # Assert: a logged, counted rejection; the rest used with their reports
    replies = report["train_replies"]
    assert (replies["rejected"], replies["used"]) == (1, NUM_CLIENTS - 1)
    assert "update-sq-norm" in replies["rejections"][0]
    assert "secure_aggregation" in caplog.text
    assert report["diagnostics"]["norms-trusted"] == 1.0
    for k in x0:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_secure_aggregation_without_norms_is_fine_for_rules_that_need_none():
    x0, clients, _ = _round_data()
    strategy = ours.FedAdam(secure_aggregation=True)
    _, _, report = _message_round(strategy, x0, clients, [{"num-examples": 3}] * 4)
    assert report["train_replies"]["used"] == NUM_CLIENTS


def _summary(strategy, caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        strategy.summary()
    return caplog.text


def test_summary_says_what_the_weighting_applies_to(caplog):
    text = _summary(ours.FedExP(), caplog)
    assert "Weighted by: 'num-examples'" not in text  # Flower's line, untrue here
    assert "Model update weighted: uniformly" in text
    assert "Metrics weighted by: 'num-examples'" in text
    text = _summary(ours.FedAvg(), caplog)
    assert "Model update weighted by: 'num-examples'" in text
    assert "Trained arrays: 2 named arrays" in _summary(
        ours.FedDuA(trainable=PARAMS), caplog
    )


def test_the_extension_point_and_the_failure_are_public():
    from fedadapt.strategies import (
        FederationFailedError,
        RoundStatistics,
        RuleStrategy,
        ServerRule,
    )
    from fedadapt.strategies.core import ServerRule as CoreServerRule
    from fedadapt.strategies.legacy import FederationFailedError as LegacyError
    from fedadapt.strategies.legacy import LegacyRuleStrategy

    assert ServerRule is CoreServerRule and LegacyError is FederationFailedError
    for name in ("FederationFailedError", "RuleStrategy", "ServerRule",
                 "RoundStatistics"):  # fmt: skip
        assert name in ours.__all__
    assert "LegacyRuleStrategy" in legacy.__all__
    assert issubclass(LegacyRuleStrategy, legacy.LegacyRuleStrategy)
    assert RoundStatistics and RuleStrategy
    strategy = ours.FedAvg(max_failed_rounds=1)
    x0, _, _ = _round_data()
    strategy.configure_train(1, _record(x0), ConfigRecord(), _grid())
    with pytest.raises(FederationFailedError):
        strategy.aggregate_train(1, [make_reply(None, {}, error=True)])
