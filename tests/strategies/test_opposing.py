"""The pull cap and the opposing projection (issue #38's second default set).

Oracles: closed forms and a step-by-step NumPy reference written here (each
client's update projected on its own, in a loop over flat vectors), and the
guarantee the projection is for: against honest clients that agree, no
client can pull Δ̄ back along their mean, whatever it sends.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedadapt import strategies as ours
from fedadapt.strategies import legacy
from fedadapt.strategies.core import FedAvgRule, FedExPRule
from fedadapt.strategies.core.aggregation import (
    contribution_scales,
    round_statistics,
)
from tests.helpers import guard_a
from tests.strategies.test_step_guard import _round

pytestmark = pytest.mark.usefixtures("task_identity")


def test_pull_cap_closed_form():
    # ω from counts (10, 10, 10, 10, 20) and norms (1, 1, 1, 1, 2): pulls
    # (10, 10, 10, 10, 40)/60, median 10/60; k = 2 scales the last to 20/40
    weights = np.array([10, 10, 10, 10, 20]) / 60
    sq_norms = [1.0, 1.0, 1.0, 1.0, 4.0]
    np.testing.assert_allclose(
        contribution_scales(weights, sq_norms, None, 2.0), [1, 1, 1, 1, 0.5]
    )
    # on top of clip factors: the pull counts the clipped norm (2 × 0.75)
    np.testing.assert_allclose(
        contribution_scales(weights, sq_norms, np.array([1, 1, 1, 1, 0.75]), 2.0),
        [1, 1, 1, 1, 0.5],
    )
    # under uniform weights and a norm bound at 2x the median it adds nothing
    uniform = np.full(5, 0.2)
    np.testing.assert_allclose(
        contribution_scales(uniform, [1, 1, 1, 1, 4], np.ones(5), 2.0), np.ones(5)
    )


def test_the_pull_cap_bounds_a_false_weight_with_the_norm_bound():
    # four clients of 10 examples with updates of norm 1; a fifth claims 1e6
    # (capped at 2x the median count: 20) and sends norm 1.98 (under 2x):
    # its pull 20·1.98 against the median 10·1 is cut to 2x that median
    x = np.zeros(4)
    up = np.array([0.5, 0.5, 0.5, 0.5])
    clients = [{"w": x + up}] * 4 + [{"w": x + 1.98 * up}]
    counts = [10, 10, 10, 10, 1_000_000]
    stats = round_statistics(
        FedAvgRule(weighting="num_examples"), {"w": x}, clients, counts,
        max_norm_ratio=2.0, clip_mode="clip", max_weight_ratio=2.0,
        max_contribution_ratio=2.0,
    )  # fmt: skip
    assert stats.clip_scales[-1] == pytest.approx(20 / (20 * 1.98))
    # Δ̄ = (4·10·up + 20·(2·10/20)·up)/60 = 60·up/60
    np.testing.assert_allclose(stats.mean_update["w"], up)


def _reference(x, clients, counts, scale_bound):
    """Step by step: weights, clip to ``scale_bound``·median, project each."""
    deltas = [
        np.concatenate([(c[k] - x[k]).ravel() for k in ("a", "b")]) for c in clients
    ]
    weights = np.asarray(counts, float) / sum(counts)
    norms = np.array([np.linalg.norm(d) for d in deltas])
    bound = scale_bound * np.median(norms)
    clipped = [d * min(1.0, bound / n) for d, n in zip(deltas, norms, strict=True)]
    total = sum(w * e for w, e in zip(weights, clipped, strict=True))
    projected = []
    for i, e in enumerate(clipped):
        others = (total - weights[i] * e) / (1 - weights[i])
        along = e @ others
        projected.append(e - along / (others @ others) * others if along < 0 else e)
    mean = sum(w * e for w, e in zip(weights, projected, strict=True))
    sq = [e @ e for e in projected]
    a = guard_a(weights, sq)  # the step guard's A (tests/helpers.py)
    without = [
        ((mean - w * e) / (1 - w), guard_a(weights, sq, leave_out=(i,)))
        for i, (w, e) in enumerate(zip(weights, projected, strict=True))
    ]
    cosines = [
        (e @ (total - w * e)) / np.linalg.norm(e) / np.linalg.norm(total - w * e)
        for w, e in zip(weights, clipped, strict=True)
    ]
    return mean, a, without, cosines


def test_projection_matches_a_step_by_step_reference():
    # six clients over two arrays: a shared direction plus noise, two of
    # them reversed (they oppose the others), one 5x too large (clipped)
    rng = np.random.default_rng(3)
    x = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5)}
    base = {k: rng.normal(size=v.shape) for k, v in x.items()}
    sign = [1, 1, 1, -1, 1, -0.5]
    size = [1, 1, 5, 1, 1, 1]
    clients = [
        {k: x[k] + size[i] * (sign[i] * base[k] + 0.7 * rng.normal(size=x[k].shape))
         for k in x}
        for i in range(6)
    ]  # fmt: skip
    counts = [10, 30, 20, 15, 25, 40]
    stats = round_statistics(
        FedExPRule(weighting="num_examples"), x, clients, counts,
        max_norm_ratio=2.0, clip_mode="clip", step_guard=True,
        project_opposing=True,
    )  # fmt: skip
    mean, a, without, cosines = _reference(x, clients, counts, 2.0)
    got = np.concatenate([stats.mean_update[k].ravel() for k in ("a", "b")])
    np.testing.assert_allclose(got, mean, rtol=1e-10, atol=1e-12)
    assert stats.mean_sq_norm == pytest.approx(a, rel=1e-10)
    np.testing.assert_allclose(stats.consensus_cos, cosines, rtol=1e-9)
    assert sum(c < 0 for c in stats.consensus_cos) == 2  # the reversed ones
    assert stats.clip_scales[2] < 1
    assert stats.without_each is not None
    for (delta, a_i), (want, want_a) in zip(stats.without_each(), without,
                                             strict=True):  # fmt: skip
        flat = np.concatenate([delta[k].ravel() for k in ("a", "b")])
        np.testing.assert_allclose(flat, want, rtol=1e-9, atol=1e-12)
        assert a_i == pytest.approx(want_a, rel=1e-9)


def _attacks(honest, bound, rng):
    """What a client that knows the projection might send, at norm ``bound``."""
    mu = np.mean(honest, axis=0)
    unit = mu / np.linalg.norm(mu)
    tries = [-unit]  # inner-product manipulation
    for _ in range(50):
        noise = rng.normal(size=mu.size)
        noise -= (noise @ unit) * unit
        noise /= np.linalg.norm(noise)
        mix = rng.uniform(-1, 0.1)  # mostly against μ, some just along it
        tries.append(mix * unit + np.sqrt(1 - mix**2) * noise)
    return [bound * t for t in tries]


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_a_client_that_knows_the_projection_cannot_pull_against_the_others(
    weighting,
):
    # Prepare: nine honest clients that agree (a shared direction, noise),
    # and a hostile tenth that sends any direction at just under 2x the
    # median norm (the norm bound), knowing every honest update
    rng = np.random.default_rng(0)
    base = rng.normal(size=20)
    honest = [base + 0.5 * rng.normal(size=20) for _ in range(9)]
    counts = [10 + 3 * i for i in range(9)] + [20]
    weights = np.asarray(counts, float) / sum(counts)
    mu = (
        sum(w * h for w, h in zip(weights[:9], honest, strict=True)) / weights[:9].sum()
    )
    assert all((h @ mu) > 0 for h in honest)
    bound = 1.98 * np.median([np.linalg.norm(h) for h in honest])
    x = np.zeros(20)
    share = 1 - (0.1 if weighting == "uniform" else weights[9])
    worst = {}
    for project in (True, False):
        along = []
        for attack in _attacks(honest, bound, rng):
            stats = round_statistics(
                FedAvgRule(weighting=weighting), {"w": x},
                [{"w": h} for h in [*honest, attack]], counts,
                max_norm_ratio=2.0, clip_mode="clip", project_opposing=project,
            )  # fmt: skip
            along.append(stats.mean_update["w"] @ mu / (mu @ mu))
        worst[project] = min(along)
    # Assert: with the projection Δ̄'s part along the others' mean is never
    # below the honest clients' own share of it (1 − ω); without it the
    # inner-product manipulation takes that share down by about ω·2‖h‖/‖μ‖
    assert worst[True] >= share * (1 - 1e-9)
    assert worst[False] < share - 0.1


def test_the_pull_cap_is_on_and_the_projection_off_by_default():
    for strategy in (ours.FedAvg(), legacy.FedExP(), ours.FedDuA()):
        assert strategy.max_contribution_ratio == 2.0
        assert not strategy.project_opposing
    assert ours.FedDuA(project_opposing=True).project_opposing


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_projection_acts_when_on_and_is_recorded_per_client(api):
    # Prepare: four clients along +up, a fifth sends −up: it opposes the
    # others' mean entirely, so the projection removes all of it
    x = np.zeros(8, dtype=np.float32)
    up = np.full(8, 0.1, dtype=np.float32)
    clients = [x + up * (1 + 0.1 * i) for i in range(4)] + [x - up]
    module = ours if api == "message" else legacy
    strategy = module.FedAvg(project_opposing=True)
    # Execute
    new = _round(api, strategy, x, clients, [10] * 5)
    # Assert: Δ̄ = Σ_{i<4} (1 + 0.1 i)·up / 5 = 0.92·up; the records say who
    np.testing.assert_allclose(new, 0.92 * up, rtol=1e-5)
    report = strategy.round_reports[1]
    assert report["diagnostics"]["projected-updates"] == 1
    records = report["clients"]
    assert [r["projected"] for r in records].count(True) == 1
    flipped = next(r for r in records if r["projected"])
    assert flipped["consensus_cos"] == pytest.approx(-1.0)
    assert all(r["consensus_cos"] > 0.99 for r in records if not r["projected"])


def test_projection_and_pull_cap_are_inactive_where_the_server_sees_sums():
    # trusted client norms (secure aggregation): nothing per client to act on
    x = {"w": np.zeros(3)}
    clients = [{"w": np.array([1.0, 0, 0])}] * 3 + [{"w": np.array([-1.0, 0, 0])}]
    stats = round_statistics(
        FedExPRule(), x, clients, [1] * 4, [1.0] * 4,
        project_opposing=True, max_contribution_ratio=2.0,
    )  # fmt: skip
    assert stats.consensus_cos is None
    np.testing.assert_allclose(stats.mean_update["w"], [0.5, 0, 0])


@pytest.mark.parametrize(
    ("count", "size", "clipped_by", "scale"),
    [
        # pull 20·1.9 above 2 × the median pull 10·1: the pull cap alone
        (20, 1.9, "pull-cap", 20 / 38),
        # norm 5 above 2 × the median norm 1: the norm bound alone (its pull
        # at the bound, 10·2, is 2 × the median pull, not above)
        (10, 5.0, "norm-bound", 2 / 5),
        # both: clipped to norm 2, then its pull 20·2 halved
        (20, 5.0, "norm-bound+pull-cap", 2 / 5 * 0.5),
    ],
)
@pytest.mark.parametrize("api", ["message", "legacy"])
def test_each_clipped_reply_says_which_bound_clipped_it(
    api, count, size, clipped_by, scale
):
    # Prepare: four clients of 10 examples with updates of norm 1 along up;
    # a fifth with ``count`` examples and an update of norm ``size``
    x = np.zeros(4, dtype=np.float32)
    up = np.full(4, 0.5, dtype=np.float32)
    clients = [x + up] * 4 + [x + np.float32(size) * up]
    module = ours if api == "message" else legacy
    strategy = module.FedAvg()  # the defaults: norm bound 2, weight and pull caps 2
    # Execute
    _round(api, strategy, x, clients, [10, 10, 10, 10, count])
    # Assert: the others untouched; the fifth clipped by the factor and bound named
    records = strategy.round_reports[1]["clients"]
    assert [r["clipped_by"] for r in records[:4]] == [None] * 4
    assert [r["clip_scale"] for r in records[:4]] == [1.0] * 4
    assert records[4]["clipped_by"] == clipped_by
    assert records[4]["clip_scale"] == pytest.approx(scale, rel=1e-5)
