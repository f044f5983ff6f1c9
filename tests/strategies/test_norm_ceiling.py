"""The norm ceiling (``max_update_norm_growth``, issue #38): no update counts
with a norm above g times the first round's median update norm.

Oracle: a closed-form case. Round 1's replies along e0 with norms 1..5 set
the anchor (median 3); round 2's along e1 with norms 10..50 are all below
the round's own bounds (2x its median, 2x its median pull), so only the
ceiling 3 x 3 = 9 clips them, each to 9, and FedAvg's new model is
x_1 + 9·e1 (without the ceiling x_1 + 30·e1, the plain mean).
"""

from __future__ import annotations

import numpy as np
import pytest

from fedadapt import strategies as ours
from fedadapt.strategies import legacy
from tests.strategies.test_step_guard import _round

pytestmark = pytest.mark.usefixtures("task_identity")

E0, E1 = np.array([1, 0, 0], np.float32), np.array([0, 1, 0], np.float32)
COUNTS = [10] * 5


def _two_rounds(api, strategy, saved=None):
    """Round 1 (norms 1..5 along e0), round 2 (10..50 along e1); x_1, x_2.

    ``saved``: load this state before round 2 (a resumed run)."""
    x0 = np.zeros(3, np.float32)
    x1 = _round(api, strategy, x0, [x0 + n * E0 for n in (1, 2, 3, 4, 5)], COUNTS)
    if saved is not None:
        saved_state = strategy.state_dict() if saved is True else saved
        strategy = type(strategy)()
        strategy.load_state_dict(saved_state)
    x2 = _round(api, strategy, x1, [x1 + n * E1 for n in (10, 20, 30, 40, 50)], COUNTS)
    return strategy, x1, x2


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_updates_are_held_to_g_times_the_first_rounds_median(api):
    module = ours if api == "message" else legacy
    strategy, x1, x2 = _two_rounds(api, module.FedAvg())  # the default, g = 3
    np.testing.assert_allclose(x1, 3 * E0, atol=1e-6)  # round 1: the plain mean
    np.testing.assert_allclose(x2, x1 + 9 * E1, atol=1e-5)
    assert strategy.aggregator_state.first_median_norm == pytest.approx(3.0)
    report = strategy.round_reports[1]  # _round calls every round round 1
    assert report["diagnostics"]["update-norm-ceiling"] == pytest.approx(9.0)
    assert report["train_replies"]["clipped"] == 5
    scales = [r["clip_scale"] for r in report["clients"]]
    np.testing.assert_allclose(scales, [9 / n for n in (10, 20, 30, 40, 50)])
    assert {r["clipped_by"] for r in report["clients"]} == {"norm-ceiling"}


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_growth_zero_is_off_and_the_plain_mean_again(api):
    module = ours if api == "message" else legacy
    strategy, x1, x2 = _two_rounds(api, module.FedAvg(max_update_norm_growth=0.0))
    np.testing.assert_allclose(x2, x1 + 30 * E1, atol=1e-5)
    assert strategy.aggregator_state.first_median_norm is None
    assert "update-norm-ceiling" not in strategy.round_reports[1]["diagnostics"]


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_a_resumed_run_keeps_the_anchor(api):
    """From a checkpoint the anchor is the first run's, not the first
    round after the restart (which would be round 2's median, 30)."""
    module = ours if api == "message" else legacy
    _, x1, resumed = _two_rounds(api, module.FedAvg(), saved=True)
    np.testing.assert_allclose(resumed, x1 + 9 * E1, atol=1e-5)
    state = module.FedAvg().state_dict()
    _, _, fresh = _two_rounds(api, module.FedAvg(), saved=state)
    np.testing.assert_allclose(fresh, x1 + 30 * E1, atol=1e-5)


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_the_ceiling_holds_where_no_other_defence_measures_norms(api):
    """No relative bound, no pull cap: the server still measures the norms
    for the anchor (in the same pass), and the ceiling still acts."""
    module = ours if api == "message" else legacy
    bare = {"max_update_norm_ratio": 0.0, "max_contribution_ratio": 0.0}
    strategy, x1, x2 = _two_rounds(api, module.FedAvg(**bare))
    np.testing.assert_allclose(x2, x1 + 9 * E1, atol=1e-5)
    assert strategy.aggregator_state.first_median_norm == pytest.approx(3.0)


def test_the_anchor_travels_in_flower_records():
    strategy, _, _ = _two_rounds("message", ours.FedAvg())
    resumed = ours.FedAvg()
    resumed.load_state_records(strategy.state_to_records())
    assert resumed.aggregator_state.first_median_norm == pytest.approx(3.0)


def test_impossible_growth_is_refused():
    with pytest.raises(ValueError, match="max_update_norm_growth"):
        ours.FedAvg(max_update_norm_growth=-1.0)


@pytest.mark.parametrize("anchor", [float("nan"), -2.0, 0.0, float("inf")])
def test_a_damaged_anchor_is_refused_when_the_state_is_loaded(anchor):
    """Not mid-run: a NaN or negative ceiling would fail every later round."""
    with pytest.raises(ValueError, match="first-median-norm"):
        ours.FedAvg().load_state_dict(
            {"rule": {}, "aggregator": {"first-median-norm": np.array(anchor)}}
        )


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_a_round_of_two_replies_does_not_anchor_the_ceiling(api):
    """The median of two replies is their mean: a client of a two-reply
    first round could lift the ceiling for good. Such a round anchors
    nothing; the next one of five does (its median, 3)."""
    module = ours if api == "message" else legacy
    strategy = module.FedAvg()
    x0 = np.zeros(3, np.float32)
    x1 = _round(api, strategy, x0, [x0 + E0, x0 + 1000 * E0], [10, 10])
    assert strategy.aggregator_state.first_median_norm is None
    _round(api, strategy, x1, [x1 + n * E1 for n in (1, 2, 3, 4, 5)], COUNTS)
    assert strategy.aggregator_state.first_median_norm == pytest.approx(3.0)


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize(
    ("colluder_norm", "anchor"),
    [(70.0, 5.5), (1e6, 5.5), (0.0, 2.5)],
    ids=["inflate", "inflate-harder", "deflate"],
)
def test_colluders_in_the_anchoring_round_move_it_by_their_number_of_ranks(
    api, colluder_norm, anchor
):
    """``anchor-inflate`` / ``anchor-deflate`` (fedadapt.attacks) against the
    ceiling: three colluders of ten in the anchoring round, honest norms
    1..7. Honest alone, the median is 4; the colluders above every honest
    norm make it the mean of the 5th and 6th honest norms, 5.5, however
    large they go; at zero, the mean of the 2nd and 3rd, 2.5. So f
    colluders can set the ceiling g times an honest norm f ranks away, no
    further."""
    module = ours if api == "message" else legacy
    strategy = module.FedAvg()
    x0 = np.zeros(3, np.float32)
    honest = [x0 + n * E0 for n in range(1, 8)]
    colluders = [x0 - colluder_norm * E1] * 3
    _round(api, strategy, x0, honest + colluders, [10] * 10)
    assert strategy.aggregator_state.first_median_norm == pytest.approx(anchor)
