"""Message-API strategies: drop-in equivalence with Flower 1.41, evaluation model
(FedDuA §5.1), rejections, reports (issue #4)."""

from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy

from fedadapt import strategies as ours
from fedadapt.server.policy import RunStrategy
from fedadapt.strategies.core import FedAvgRule, FedDuARule, FedExPRule
from tests.helpers import NO_DEFENCE, make_reply

SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 8)}


pytestmark = pytest.mark.usefixtures("task_identity")


def _grid(num_nodes=4):
    grid = Mock(spec=Grid)
    grid.get_node_ids.return_value = list(range(1, num_nodes + 1))
    return grid


def _record(arrays):
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _numpy(record):
    return {k: v.numpy() for k, v in record.items()}


def _replies(current, rng, num_examples, scale=0.05):
    replies = []
    for node, n in enumerate(num_examples, start=1):
        arrays = {
            k: (x + scale * rng.normal(size=x.shape)).astype(np.float32)
            for k, x in current.items()
        }
        replies.append(make_reply(arrays, {"num-examples": int(n), "loss": 1.0}, node))
    return replies


def _run_rounds(strategy, x0, replies_per_round):
    arrays = _record(x0)
    outputs = []
    for server_round, make in enumerate(replies_per_round, start=1):
        list(strategy.configure_train(server_round, arrays, ConfigRecord(), _grid()))
        new, _ = strategy.aggregate_train(server_round, make(_numpy(arrays)))
        arrays = new if new is not None else arrays
        outputs.append(_numpy(arrays))
    return outputs


def _equivalence(ours_cls, flower_cls, kwargs, rounds=5, seed=0):
    rng = np.random.default_rng(seed)
    x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    seeds = [int(s) for s in rng.integers(0, 2**31, size=rounds)]
    sizes = [[5, 17, 40], [12, 3, 30], [50, 8, 9], [7, 7, 21], [33, 1, 4]]

    def factories():
        return [
            (lambda cur, s=s, n=n: _replies(cur, np.random.default_rng(s), n))
            for s, n in zip(seeds, sizes[:rounds] * 2, strict=False)
        ]

    # the same arguments, fedadapt's defences off (they act on these replies)
    got = _run_rounds(ours_cls(**{**NO_DEFENCE, **kwargs}), x0, factories())
    want = _run_rounds(flower_cls(**kwargs), x0, factories())
    for g, w in zip(got, want, strict=True):
        for k in SHAPES:
            # float32: summation order differs, and Adagrad with a tiny τ amplifies
            # the rounding of near-zero Δ̄ entries (each step is ≈ η·sign(Δ̄) there)
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=2e-5)
    return got


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("FedAdam", {}),
        ("FedAdam", {"eta": 0.03, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-2}),
        ("FedAdagrad", {}),
        ("FedAdagrad", {"eta": 0.5, "tau": 1e-4}),
        ("FedYogi", {}),
        ("FedYogi", {"eta": 0.1, "beta_2": 0.9}),
        ("FedAvg", {}),
        ("FedAvgM", {"server_learning_rate": 0.8, "server_momentum": 0.9}),
    ],
)
def test_drop_in_equivalence_with_flower(name, kwargs):
    """Drop-in: same arguments → same global arrays as flwr.serverapp.strategy.*."""
    _equivalence(getattr(ours, name), getattr(flwr_strategy, name), kwargs)


def test_fedadam_equivalence_detects_a_different_rule():
    """The equivalence harness can fail: papers' FedAdam differs from Flower's."""
    with pytest.raises(AssertionError):
        _equivalence(
            lambda **kw: ours.FedAdam(bias_correction="none", **kw),
            flwr_strategy.FedAdam,
            {},
        )


def test_strategies_keep_flowers_sampling_and_config():
    strategy = ours.FedDuA(fraction_train=0.5, min_train_nodes=2, min_available_nodes=2)
    # one generic adapter: every strategy is Flower's FedAvg with a rule
    assert isinstance(strategy, flwr_strategy.FedAvg)
    assert isinstance(ours.FedAdam(), ours.RuleStrategy)
    messages = list(
        strategy.configure_train(3, _record({"w": np.zeros(2, np.float32)}),
                                 ConfigRecord({"lr": 0.1}), _grid(8))
    )  # fmt: skip
    assert len(messages) == 4
    assert messages[0].content["config"]["server-round"] == 3
    assert messages[0].content["config"]["lr"] == 0.1


def test_feddua_evaluates_the_average_of_the_last_two_iterates():
    """FedDuA §5.1 (last-two-iterate averaging "as in" FedExP, arXiv:2301.09604).

    The round's model (returned, evaluated) = (w_t + w_{t+1})/2; training
    continues from w_{t+1}.
    """
    x0 = {"w": np.zeros(3, np.float32)}
    strategy = ours.FedDuA(epsilon=0.0)
    sent = _record(x0)
    list(strategy.configure_train(1, sent, ConfigRecord(), _grid()))
    replies = [
        make_reply({"w": np.array([1.0, 2.0, 0.5], np.float32)}, {"num-examples": 3}),
        make_reply({"w": np.array([3.0, 0.0, 0.5], np.float32)}, {"num-examples": 1}),
    ]
    returned, _ = strategy.aggregate_train(1, replies)
    # uniform weighting (paper): Δ̄ = (2, 1, 0.5); round-0 step of DUA Alg. 1
    # lines 12, 15-17 with ε = ε_g = 0: A/(2‖Δ̄‖₁)·sign(Δ̄)
    a = (1 + 4 + 0.25 + 9 + 0 + 0.25) / 2
    w1 = a / (2 * 3.5) * np.ones(3)
    np.testing.assert_allclose(_numpy(strategy.training_arrays)["w"], w1, rtol=1e-6)
    np.testing.assert_allclose(_numpy(returned)["w"], w1 / 2, rtol=1e-6)
    assert strategy.latest_arrays is returned
    # Flower hands the returned model to the next round: clients get w_1
    messages = list(strategy.configure_train(2, returned, ConfigRecord(), _grid()))
    np.testing.assert_allclose(
        messages[0].content["arrays"]["w"].numpy(), w1, rtol=1e-6
    )
    off = ours.FedDuA(average_last_two=False)
    list(off.configure_train(1, sent, ConfigRecord(), _grid()))
    new_off, _ = off.aggregate_train(1, replies)
    assert off.training_arrays is new_off


@pytest.mark.parametrize("cls", [ours.FedDuA, ours.FedExP, ours.FedAdam, ours.FedAvg])
def test_bad_replies_are_rejected_and_reported(cls):
    x0 = {"w": np.zeros(3, np.float32), "n": np.array(4, np.int64)}
    strategy = cls()
    list(strategy.configure_train(1, _record(x0), ConfigRecord(), _grid()))
    good = {"w": np.ones(3, np.float32), "n": np.array(6, np.int64)}
    replies = [
        make_reply(good, {"num-examples": 2, "update-sq-norm": 3.0}, node_id=1),
        make_reply({**good, "w": np.array([np.nan, 0, 0], np.float32)},
                   {"num-examples": 2}, node_id=2),
        make_reply({**good, "n": np.array(6.0)}, {"num-examples": 2}, node_id=3),
        make_reply(good, {"num-examples": 2, "update-sq-norm": -1.0}, node_id=4),
        make_reply(None, {}, node_id=5, error=True),
    ]  # fmt: skip
    new, metrics = strategy.aggregate_train(1, replies)
    report = strategy.round_reports[1]
    assert report["train_replies"]["received"] == 5
    assert report["train_replies"]["failed"] == 1
    assert report["train_replies"]["rejected"] == 3
    assert report["train_replies"]["used"] == 1
    assert new["n"].numpy().dtype == np.int64 and int(new["n"].numpy()) == 6
    assert np.all(np.isfinite(new["w"].numpy()))
    assert report["diagnostics"]["server-lr"] is not None
    assert metrics["loss"] if "loss" in metrics else True


def test_round_without_valid_replies_keeps_the_model_and_says_so(caplog):
    strategy = ours.FedDuA()
    list(strategy.configure_train(1, _record({"w": np.zeros(2, np.float32)}),
                                  ConfigRecord(), _grid()))  # fmt: skip
    bad = make_reply({"w": np.full(2, np.inf, np.float32)}, {"num-examples": 1})
    assert strategy.aggregate_train(1, [bad]) == (None, None)
    assert strategy.aggregate_train(2, []) == (None, None)
    assert "no usable replies" in caplog.text


def test_reported_norm_path_equals_recomputed_path():
    """Issue #4: trusted update-sq-norm (secure aggregation) == recomputing."""
    rng = np.random.default_rng(1)
    x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    clients = [
        {
            k: (x + 0.1 * rng.normal(size=x.shape)).astype(np.float32)
            for k, x in x0.items()
        }
        for _ in range(3)
    ]
    sq = [
        float(sum(np.sum((c[k].astype(np.float64) - x0[k]) ** 2) for k in x0))
        for c in clients
    ]

    def run(secure):
        strategy = ours.FedDuA(secure_aggregation=secure, step_guard=False)
        list(strategy.configure_train(1, _record(x0), ConfigRecord(), _grid()))
        replies = [
            make_reply(c, {"num-examples": 5, "update-sq-norm": s})
            for c, s in zip(clients, sq, strict=True)
        ]
        new, _ = strategy.aggregate_train(1, replies)
        assert strategy.round_reports[1]["train_replies"]["norm_mismatches"] == 0
        return _numpy(new), strategy.round_reports[1]["diagnostics"]

    (a, da), (b, db) = run(True), run(False)
    assert da["norms-trusted"] == 1.0 and db["norms-trusted"] == 0.0
    for k in SHAPES:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5)


@pytest.mark.parametrize("with_norms", [True, False])
@pytest.mark.parametrize(("kwargs", "eta"), [({}, 2.0), ({"eps_form": "times_S"}, 1.5)])
def test_fedexp_adapter_closed_form_step(with_norms, kwargs, eta):
    """Δ_1 = (2, 0), Δ_2 = (−2, 2), ε = ½: η = 6/(2(1+½)) = 2; ε·|S|: 1.5.

    The ratio is above 1, so a wrong factor or ε placement changes η; the
    clients' reported ‖Δ_i‖² and the server's own norms must agree.
    """
    x0 = {"w": np.array([10.0, 20.0], np.float32)}
    deltas = [np.array([2.0, 0.0]), np.array([-2.0, 2.0])]
    # the two updates oppose (⟨Δ_1, Δ_2⟩ < 0): the projection would act
    strategy = ours.FedExP(epsilon=0.5, project_opposing=False, **kwargs)
    list(strategy.configure_train(1, _record(x0), ConfigRecord(), _grid()))
    replies = [
        make_reply(
            {"w": (x0["w"] + d).astype(np.float32)},
            {"num-examples": n, **({"update-sq-norm": float(d @ d)} if with_norms
                                   else {})},
            node,
        )
        for node, (d, n) in enumerate(zip(deltas, [3, 1], strict=True), start=1)
    ]  # fmt: skip
    strategy.aggregate_train(1, replies)
    assert strategy.round_reports[1]["diagnostics"]["server-lr"] == pytest.approx(eta)
    w1 = _numpy(strategy.training_arrays)["w"]  # the iterate, not the average
    np.testing.assert_allclose(w1, [10.0, 20.0 + eta], rtol=1e-6)


def test_round_offset_shifts_rounds_seen_by_clients_and_reports():
    strategy = RunStrategy(FedExPRule(), round_offset=10)
    msgs = list(strategy.configure_train(1, _record({"w": np.zeros(2, np.float32)}),
                                         ConfigRecord(), _grid()))  # fmt: skip
    assert msgs[0].content["config"]["server-round"] == 11
    strategy.aggregate_train(1, [make_reply({"w": np.ones(2, np.float32)},
                                            {"num-examples": 1})])  # fmt: skip
    assert 11 in strategy.round_reports


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: ours.FedAdam(eta=0.0), "Invalid eta"),
        (lambda: ours.FedAdam(beta_1=1.5), "Invalid beta_1"),
        (lambda: ours.FedYogi(tau=-1.0), "Invalid tau"),
        (lambda: ours.FedDuA(variant="sgd"), "Invalid variant"),
        (lambda: ours.FedDuA(epsilon=-1.0), "Invalid epsilon"),
        (lambda: ours.FedExP(epsilon=-1.0), "Invalid epsilon"),
        (lambda: ours.FedExP(server_momentum=-0.1), "Invalid server_momentum"),
        (
            lambda: ours.FedAvgM(server_learning_rate=0.0),
            "Invalid server_learning_rate",
        ),
    ],
)
def test_invalid_hyperparameters_raise_at_construction(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


def test_reply_whose_data_contradict_its_metadata_is_rejected():
    """Shapes are checked from metadata first; lying metadata is caught on read."""
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.ones(2, np.float32))
    liar = Array(
        dtype="float32", shape=(3,), stype="numpy.ndarray", data=buffer.getvalue()
    )
    strategy = ours.FedAvg()
    list(strategy.configure_train(1, _record({"w": np.zeros(3, np.float32)}),
                                  ConfigRecord(), _grid()))  # fmt: skip
    good = make_reply({"w": np.full(3, 2.0, np.float32)}, {"num-examples": 1}, 1)
    bad = make_reply({"w": np.zeros(3, np.float32)}, {"num-examples": 1}, 2)
    bad.content["arrays"] = ArrayRecord({"w": liar})
    new, _ = strategy.aggregate_train(1, [good, bad])
    np.testing.assert_allclose(new["w"].numpy(), 2.0)
    report = strategy.round_reports[1]["train_replies"]
    assert (report["rejected"], report["used"]) == (1, 1)
    assert "do not match its metadata" in report["rejections"][0]


def test_node_loss_samples_from_the_nodes_still_connected():
    """3 of 4 wanted nodes connected: after the grace period, sample those 3."""
    strategy = RunStrategy(FedDuARule(), fraction_train=1.0, min_train_nodes=4,
                           min_available_nodes=4, fraction_evaluate=1.0,
                           min_evaluate_nodes=4, node_grace_s=0.05)  # fmt: skip
    arrays = _record({"w": np.zeros(3, np.float32)})
    grid = _grid(num_nodes=3)
    train = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    evaluate = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in train) == [1, 2, 3]
    assert len(evaluate) == 3
    assert strategy.round_reports[1]["nodes"] == {
        "train": {"wanted": 4, "connected": 3},
        "evaluate": {"wanted": 4, "connected": 3},
    }
    # the minimums come back: a returning node is sampled again
    assert (strategy.min_train_nodes, strategy.min_available_nodes) == (4, 4)
    full = list(strategy.configure_train(2, arrays, ConfigRecord(), _grid(4)))
    assert len(full) == 4 and "nodes" not in strategy.round_reports.get(2, {})


def test_node_that_returns_within_the_grace_period_is_waited_for():
    strategy = RunStrategy(FedAvgRule(), fraction_train=1.0, min_train_nodes=3,
                           min_available_nodes=3, node_grace_s=5.0)  # fmt: skip
    grid = Mock(spec=Grid)
    grid.get_node_ids.side_effect = [[1, 2], [1, 2], [1, 2, 3]] + [[1, 2, 3]] * 10
    arrays = _record({"w": np.zeros(3, np.float32)})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert len(messages) == 3
    assert "nodes" not in strategy.round_reports.get(1, {})


def test_after_a_loss_later_rounds_do_not_wait_again_and_never_hang():
    """The grace wait happens once per loss; sampling uses one snapshot."""
    strategy = RunStrategy(FedAvgRule(), fraction_train=1.0, min_train_nodes=3,
                           min_available_nodes=3, node_grace_s=0.2)  # fmt: skip
    arrays = _record({"w": np.zeros(3, np.float32)})
    grid = _grid(num_nodes=2)
    list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    polls = grid.get_node_ids.call_count
    assert polls > 1  # waited for the missing node
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    assert grid.get_node_ids.call_count == polls + 1 and len(messages) == 2
    # a node lost between our look and Flower's sampling: the snapshot is sampled
    racing = Mock(spec=Grid)
    racing.get_node_ids.side_effect = [[1, 2, 3]] + [[1, 2]] * 100
    messages = list(strategy.configure_train(3, arrays, ConfigRecord(), racing))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3]


def test_the_generic_adapter_with_a_rule_is_the_public_class():
    """Public classes only build the rule: RuleStrategy(rule) gives the same
    arrays, and anything but a rule is refused at construction."""
    from fedadapt.strategies.core import FedAdamRule

    arrays = _record({"w": np.zeros(3, np.float32)})
    outputs = []
    for strategy in (
        ours.FedAdam(eta=0.05, tau=1e-2),
        ours.RuleStrategy(FedAdamRule(eta=0.05, tau=1e-2)),
    ):
        current = arrays
        for server_round in (1, 2):
            list(strategy.configure_train(server_round, current, ConfigRecord(),
                                          _grid()))  # fmt: skip
            current, _ = strategy.aggregate_train(
                server_round,
                [make_reply({"w": np.full(3, 0.1 * n, np.float32)},
                            {"num-examples": n}, n) for n in (1, 2)],
            )  # fmt: skip
        outputs.append(_numpy(current)["w"])
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert not np.allclose(outputs[0], 0.0)
    with pytest.raises(TypeError, match="ServerRule"):
        ours.RuleStrategy("fedadam")
