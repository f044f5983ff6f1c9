"""Issue #38 item 2: ``aggregation="auto"``, every strategy's default.

Oracles: the same strategy with the aggregator written out (multi-Krum for
FedAdam; centered clipping for FedExP and FedDuAdagrad; the mean for the
others: the choice docs/robustness.md measured), the mean
written out for the rounds and modes in which ``auto`` is the mean, and
the plain NumPy mean for the centre centered clipping carries over a round
too small to clip in.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedadapt import strategies as ours
from fedadapt.config import validate_run_config
from fedadapt.errors import ConfigError
from fedadapt.strategies import legacy
from fedadapt.strategies.adapter import AUTO_AGGREGATION, round_aggregation
from fedadapt.strategies.core import FedAvgRule, FedExPRule
from tests.strategies.test_hostile import FACTOR, _honest, _multi_step

pytestmark = pytest.mark.usefixtures("task_identity")

#: (strategy, its arguments, the aggregator "auto" is in a round of ten)
CHOICES = [
    ("FedAvg", {}, "mean"),
    ("FedAvgM", {}, "trimmed_mean"),
    ("FedAdam", {}, "multi_krum"),
    ("FedAdagrad", {}, "mean"),
    ("FedYogi", {}, "mean"),
    ("FedExP", {}, "centered_clipping"),
    ("FedExPM", {}, "mean"),
    ("FedDuA", {}, "mean"),
    ("FedDuA", {"variant": "adagrad"}, "centered_clipping"),
]


def _rounds(api, strategy, sizes, hostile=True):
    """Rounds of ``sizes`` replies (client 0 sends ×1e6 if ``hostile``)."""
    x = None
    for server_round, size in enumerate(sizes, start=1):
        x0, clients = _honest(server_round, size)
        if hostile:
            clients[0] = {
                k: x0[k] + FACTOR * (v - x0[k]) if v.dtype.kind == "f" else v
                for k, v in clients[0].items()
            }
        x = _multi_step(api, strategy, server_round, x0, clients)
    return x


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize(("name", "kwargs", "chosen"), CHOICES)
def test_auto_is_the_rules_measured_aggregator(name, kwargs, chosen, api):
    # Prepare: the default and the aggregator written out
    module = ours if api == "message" else legacy
    default = getattr(module, name)(**kwargs)
    trim = {"trim_fraction": 0.1} if chosen == "trimmed_mean" else {}
    written = getattr(module, name)(aggregation=chosen, **trim, **kwargs)
    assert default.aggregation == AUTO_AGGREGATION
    # Execute: three rounds of ten replies, one of them hostile
    got = _rounds(api, default, [10, 10, 10])
    want = _rounds(api, written, [10, 10, 10])
    # Assert: the same model, bit for bit; the rule names its choice
    assert default.rule.robust_aggregation == chosen
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


#: (strategy, its arguments, num_hostile f, what "auto" runs with that f in
#: a round of ten): the trimmed mean cutting f at each end past
#: AUTO_MAX_HOSTILE, the rule's own aggregator up to it
TOLD_OF_COLLUDERS = [
    ("FedAvg", {}, 2, "trimmed_mean"),
    ("FedYogi", {}, 2, "trimmed_mean"),
    ("FedExPM", {}, 3, "trimmed_mean"),
    ("FedExP", {}, 2, "centered_clipping"),
    ("FedExP", {}, 3, "trimmed_mean"),
    ("FedDuA", {"variant": "adagrad"}, 3, "trimmed_mean"),
    ("FedAvgM", {}, 2, "trimmed_mean"),
    ("FedAvgM", {}, 3, "trimmed_mean"),
    ("FedAdam", {}, 1, "multi_krum"),
    ("FedAdam", {}, 2, "trimmed_mean"),
]


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize(("name", "kwargs", "f", "chosen"), TOLD_OF_COLLUDERS)
def test_auto_told_of_colluders_runs_an_aggregator_that_uses_f(
    name, kwargs, f, chosen, api
):
    # Prepare: the default told f, and the aggregator written out with f
    # (the trimmed mean cutting f values at each end of ten)
    module = ours if api == "message" else legacy
    told = getattr(module, name)(num_hostile=f, **kwargs)
    trim = {"trim_fraction": f / 10} if chosen == "trimmed_mean" else {}
    written = getattr(module, name)(aggregation=chosen, num_hostile=f, **trim, **kwargs)
    # Execute: three rounds of ten replies (2f + 3 fit), one hostile
    got, want = _rounds(api, told, [10] * 3), _rounds(api, written, [10] * 3)
    # Assert: bit for bit the aggregator written out; under 2f + 3 the mean
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    assert round_aggregation("auto", told.rule, 10, f) == chosen
    assert round_aggregation("auto", told.rule, 2 * f + 2, f) == "mean"


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_auto_told_of_colluders_says_when_a_round_is_too_small_for_them(api, caplog):
    # Prepare: told f = 2 (Krum's 2f + 3 = 7), rounds of six and of seven
    module = ours if api == "message" else legacy
    told, mean = module.FedAvg(num_hostile=2), module.FedAvg(aggregation="mean")
    # Execute
    got, want = _rounds(api, told, [6], hostile=False), _rounds(api, mean, [6], False)
    small = caplog.text
    caplog.clear()
    _rounds(api, module.FedAvg(num_hostile=2), [7], hostile=False)
    # Assert: the mean, and a warning naming the round size it needed; none
    # where the round fits f
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    assert "aggregation=auto runs the mean: 6 replies, fewer than the 7" in small
    assert "aggregation=auto runs the mean" not in caplog.text


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize("name", ["FedAdam", "FedExP"])
def test_auto_is_the_mean_in_rounds_too_small_to_outvote_a_client(name, api):
    # Prepare: four replies, fewer than the 2f + 3 = 5 Krum needs
    module = ours if api == "message" else legacy
    default, mean = getattr(module, name)(), getattr(module, name)(aggregation="mean")
    # Execute
    got = _rounds(api, default, [4, 4], hostile=False)
    want = _rounds(api, mean, [4, 4], hostile=False)
    # Assert: the papers' method, as in a quickstart of two clients
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_the_centre_follows_a_round_that_was_too_small_to_clip(api):
    # Prepare: FedExP (uniform weights), a round of four honest replies
    module = ours if api == "message" else legacy
    strategy = module.FedExP()
    x0, clients = _honest(1, 4)
    # Execute
    _multi_step(api, strategy, 1, x0, clients)
    # Assert: the centre of the next (clipped) round is this round's mean
    # Δ̄ over the arrays the rule steps on (the BatchNorm buffer is averaged)
    center = list(strategy.aggregator_state.center.values())
    want = np.mean([c["fc.weight"] - x0["fc.weight"] for c in clients], axis=0)
    np.testing.assert_allclose(center[0], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_turning_on_the_opposing_projection_gets_the_mean_it_acts_on(api):
    # Prepare: FedExP (whose "auto" is centered clipping) with the opt-in
    # projection, and the same on the mean written out
    module = ours if api == "message" else legacy
    default = module.FedExP(project_opposing=True)
    mean = module.FedExP(project_opposing=True, aggregation="mean")
    # Execute: rounds of ten, one hostile
    got = _rounds(api, default, [10, 10])
    want = _rounds(api, mean, [10, 10])
    # Assert: the projection acts (it is inactive under any robust
    # aggregator), so asking for it is not a silent no-op
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    records = default.round_reports[2]["clients"]
    assert all(r["consensus_cos"] is not None for r in records)


def test_auto_is_the_mean_where_the_server_cannot_judge_each_update():
    # Prepare / Execute / Assert: sums only (secure aggregation), the
    # influence screen (measured over the mean), and any rule without one
    rule = FedExPRule()
    assert round_aggregation("auto", rule, 10) == "centered_clipping"
    assert round_aggregation("auto", rule, 4) == "mean"
    assert round_aggregation("auto", rule, 10, mean_required=True) == "mean"
    assert round_aggregation("auto", rule, 10, num_hostile=4) == "mean"  # 2f+3 = 11
    assert round_aggregation("auto", FedAvgRule(), 10) == "mean"
    assert round_aggregation("median", rule, 2) == "median"  # written out: as given
    # the strategies accept the default where a written-out aggregator fails
    legacy.FedExP(secure_aggregation="secagg+")
    ours.FedExP(validation_loss=lambda arrays: 0.0)
    with pytest.raises(ValueError, match="only their sum"):
        legacy.FedExP(secure_aggregation="secagg+", aggregation="centered_clipping")
    with pytest.raises(ValueError, match="influence screen"):
        ours.FedExP(validation_loss=lambda arrays: 0.0, aggregation="multi_krum")


def test_run_config_default_is_auto_and_is_the_mean_under_secure_aggregation():
    # Prepare / Execute
    config = validate_run_config(
        {"strategy": "fedexp", "secure-aggregation": "secagg+"}
    )
    # Assert: the default runs under SecAgg+; a written-out aggregator cannot
    assert config["aggregation"] == "auto"
    with pytest.raises(ConfigError, match="aggregation"):
        validate_run_config({"strategy": "fedexp", "secure-aggregation": "secagg+",
                             "aggregation": "centered-clipping"})  # fmt: skip


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize("bad", ["nan", "inf", "shape"])
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("FedAdam", {}),
        ("FedExP", {}),
        ("FedAvgM", {}),
        # the coordinate-wise aggregators written out: a cut value must not
        # vanish unseen (a partition sorts NaN and Inf to the ends it cuts)
        ("FedAvg", {"aggregation": "median"}),
        ("FedAvg", {"aggregation": "trimmed_mean"}),
    ],
)
def test_a_broken_reply_is_rejected_under_the_default_aggregators(
    name, kwargs, bad, api
):
    # Prepare: ten replies, one with NaN or Inf arrays or arrays of the wrong
    # shape (a trimmed mean or median must not merely cut it away unseen)
    strategy = getattr(ours if api == "message" else legacy, name)(**kwargs)
    x0, clients = _honest(1, 10)
    broken = {
        "nan": lambda v: v * np.nan,
        "inf": lambda v: np.full_like(v, np.inf),
        "shape": lambda v: np.zeros((3, 3), v.dtype),
    }[bad]
    clients[2] = {k: broken(v) if v.dtype.kind == "f" else v
                  for k, v in clients[2].items()}  # fmt: skip
    # Execute
    x = _multi_step(api, strategy, 1, x0, clients)
    # Assert: counted and left out; the model the others give is finite
    report = strategy.round_reports[1]["train_replies"]
    assert (report["used"], report["rejected"]) == (9, 1)
    assert all(np.isfinite(v).all() for v in x.values())


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize(("size", "one_cut"), [(10, 0.1), (5, 0.2), (7, 0.15)])
def test_fedavgm_auto_cuts_one_value_at_each_end_in_any_round(api, size, one_cut):
    """Under ``auto`` FedAvgM's trimmed mean cuts f = ``num_hostile`` = 1
    value at each end of every coordinate, whatever the round's size (a
    fixed 0.1 would cut nothing in a round of five) and whatever
    ``trim_fraction`` says (it is for ``trimmed_mean`` written out)."""
    module = ours if api == "message" else legacy
    got = _rounds(api, module.FedAvgM(trim_fraction=0.4), [size, size])
    sizes = [size, size]
    written = module.FedAvgM(aggregation="trimmed_mean", trim_fraction=one_cut)
    want = _rounds(api, written, sizes)
    no_cut = module.FedAvgM(aggregation="trimmed_mean", trim_fraction=0.0)
    uncut = _rounds(api, no_cut, sizes)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    # a value was cut (0.1 of five or seven would have cut none)
    assert any(not np.array_equal(got[k], uncut[k]) for k in want)


def test_auto_trim_fraction_cuts_exactly_f_values_in_every_round_auto_trims():
    from fedadapt.strategies.adapter import auto_trim_fraction

    for n in range(3, 200):
        for f in range(0, (n - 3) // 2 + 1):  # n >= 2f + 3, where auto trims
            fraction = auto_trim_fraction(f, n)
            assert int(fraction * n) == f and 0 <= fraction < 0.5, (f, n)


def _cut_by_sorting(stack, cut):
    """Reference: per client, coordinates outside [sorted[cut], sorted[n-cut-1]]."""
    n = stack.shape[0]
    ordered = np.sort(stack, axis=0)
    low, high = ordered[cut], ordered[n - cut - 1]
    return ((stack < low) | (stack > high)).reshape(n, -1).sum(axis=1)


def test_trimmed_counts_name_the_clients_the_trimmed_mean_cut():
    from fedadapt.strategies.core.aggregation import trimmed_counts

    # closed form: five clients, one value at each end cut; a tie at an end
    # (column 1: all equal; column 3: two share the minimum) cuts nobody there
    stack = np.array(
        [[0.0, 1, 5, 0], [1, 1, 4, 0], [2, 1, 3, 1], [3, 1, 2, 2], [10, 1, 1, 3]]
    )
    np.testing.assert_array_equal(trimmed_counts(stack, 1), [2, 0, 0, 0, 3])
    # the cut-1 shortcut and the partition agree with sorting, ties included
    rng = np.random.default_rng(0)
    for n, cut in [(5, 1), (10, 1), (10, 2), (10, 3), (7, 2)]:
        stack = rng.integers(-3, 4, size=(n, 6, 5)).astype(np.float32)
        np.testing.assert_array_equal(
            trimmed_counts(stack, cut), _cut_by_sorting(stack, cut)
        )
    assert not trimmed_counts(stack, 0).any()


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_the_trimmed_mean_records_the_share_it_cut_of_each_client(api):
    """FedAvgM's default trimmed mean (one value cut at each end) says per
    reply which share of its coordinates it cut (``trimmed_share``). Nine
    honest updates 1 + noise per coordinate, one client sending −1 (a sign
    flip well within the norm bound): it is the smallest value of every
    coordinate, so its share is 1, and the nine honest share the largest
    value, summing to 1."""
    from fedadapt.server.client_records import flatten

    module = ours if api == "message" else legacy
    rng = np.random.default_rng(3)
    x0 = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(3, np.float32)}
    clients = [
        {k: (1 + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
         for k, v in x0.items()}
        for _ in range(10)
    ]  # fmt: skip
    clients[0] = {k: -np.ones_like(v) for k, v in x0.items()}
    strategy = module.FedAvgM()
    _multi_step(api, strategy, 1, x0, clients)
    records = strategy.round_reports[1]["clients"]
    shares = [r["trimmed_share"] for r in records]
    assert shares[0] == 1.0
    assert sum(shares[1:]) == pytest.approx(1.0) and max(shares[1:]) < 0.5
    assert flatten(records[0])["trimmed_share"] == 1.0
    assert strategy.round_reports[1]["diagnostics"]["trimmed-share-max"] == 1.0
    # the mean records none
    mean = module.FedAvgM(aggregation="mean")
    _multi_step(api, mean, 1, x0, clients)
    assert all(r["trimmed_share"] is None for r in mean.round_reports[1]["clients"])
