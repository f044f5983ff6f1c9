"""The attack suite's hostile updates (fedadapt.attacks) against their definitions.

Oracles: the formulas of algorithms-spec.md §12 written out here per
attack (sign flip, orthogonal, ALIE's z_max from the standard normal
quantile, IPM), computed on small hand-made updates.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from fedadapt.attacks import (
    ATTACKS,
    FALSE_REPORT_FACTOR,
    INFLATE_FACTOR,
    UNBOUNDED_SCALE,
    UNDER_BOUND,
    RoundView,
    alie_z,
    craft,
    norm,
)
from fedadapt.strategies.core.robust import (
    bulyan_select,
    centered_clipping,
    krum_select,
    pairwise_sq_distances,
)


def _honest(seed=0, n=7, dim=6):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=dim)
    return [{"w": (base + 0.3 * rng.normal(size=dim)).astype(np.float32),
             "steps": np.array(3, dtype=np.int64)} for _ in range(n)]  # fmt: skip


def _view(cap=math.inf, f=1):
    honest = _honest()
    own = _honest(seed=1, n=f)
    return RoundView(honest, own, cap, [10.0] * len(honest), seed=3)


def _mu(view):
    return np.mean([h["w"].astype(np.float64) for h in view.honest], axis=0)


@pytest.mark.parametrize("cap", [math.inf, 2.5])
def test_sign_flip_points_against_its_own_update_just_under_the_cap(cap):
    view = _view(cap)
    (reply,) = craft("sign-flip", view)
    own = view.own[0]["w"].astype(np.float64)
    expected_norm = (
        UNDER_BOUND * cap if math.isfinite(cap) else UNBOUNDED_SCALE * norm(view.own[0])
    )
    sent = reply.update["w"].astype(np.float64)
    assert norm(reply.update) == pytest.approx(expected_norm, rel=1e-5)
    cosine = sent @ own / (np.linalg.norm(sent) * np.linalg.norm(own))
    assert cosine == pytest.approx(-1.0, abs=1e-6)
    assert reply.update["steps"] == view.own[0]["steps"]  # integer arrays untouched
    assert reply.claims == {}


def test_orthogonal_has_no_component_along_the_honest_mean():
    view = _view(cap=2.0)
    (reply,) = craft("orthogonal", view)
    sent = reply.update["w"].astype(np.float64)
    mu = _mu(view)
    assert abs(sent @ mu) / (np.linalg.norm(sent) * np.linalg.norm(mu)) < 1e-5
    assert norm(reply.update) == pytest.approx(UNDER_BOUND * 2.0, rel=1e-5)


@pytest.mark.parametrize(("n", "f"), [(10, 1), (10, 2), (10, 3), (20, 5)])
def test_alie_z_is_baruchs_z_max(n, f):
    s = math.floor(n / 2 + 1) - f
    assert alie_z(n, f) == pytest.approx(NormalDist().inv_cdf((n - s) / n))
    assert alie_z(10, 1) == pytest.approx(0.0)


def test_alie_sends_mean_minus_z_sigma_from_every_colluder():
    view = _view(f=3)
    replies = craft("alie", view)
    stack = np.stack([h["w"].astype(np.float64) for h in view.honest])
    z = alie_z(view.num_clients, 3)
    expected = stack.mean(axis=0) - z * stack.std(axis=0)
    assert len(replies) == 3
    for reply in replies:
        np.testing.assert_allclose(reply.update["w"], expected, rtol=1e-5)


def test_ipm_is_a_negative_multiple_of_the_honest_mean_at_the_cap():
    view = _view(cap=1.5)
    (reply,) = craft("ipm", view)
    sent = reply.update["w"].astype(np.float64)
    mu = _mu(view)
    epsilon = -(sent @ mu) / (mu @ mu)
    np.testing.assert_allclose(sent, -epsilon * mu, rtol=1e-5, atol=1e-7)
    assert epsilon > 0
    assert norm(reply.update) == pytest.approx(UNDER_BOUND * 1.5, rel=1e-5)


def test_scaled_copy_scales_its_own_update_up_never_down():
    up = craft("scaled-copy", _view(cap=100.0))[0]
    own = _view().own[0]
    ratio = up.update["w"] / own["w"]
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-5)
    assert norm(up.update) == pytest.approx(UNDER_BOUND * 100.0, rel=1e-5)
    same = craft("scaled-copy", _view(cap=1e-3))[0]
    np.testing.assert_array_equal(same.update["w"], own["w"])


def test_false_reports_claim_what_the_attack_says():
    view = _view()
    (norm_lie,) = craft("false-norm", view)
    np.testing.assert_array_equal(norm_lie.update["w"], view.own[0]["w"])
    assert norm_lie.claims["update-sq-norm"] == pytest.approx(
        FALSE_REPORT_FACTOR * norm(view.own[0]) ** 2
    )
    (weight_lie,) = craft("false-weight", view)
    assert weight_lie.claims == {"num-examples": FALSE_REPORT_FACTOR * 10.0}
    np.testing.assert_array_equal(
        weight_lie.update["w"], craft("sign-flip", view)[0].update["w"]
    )


def test_every_attack_is_crafted_and_an_unknown_one_is_refused():
    view = _view(cap=2.0, f=2)
    for attack in ATTACKS:
        replies = craft(attack, view)
        assert len(replies) == 2
        assert all(np.all(np.isfinite(r.update["w"])) for r in replies)
    with pytest.raises(ValueError, match="unknown attack"):
        craft("gradient-ascent", view)


def test_quiet_flip_is_the_own_update_reversed_at_its_own_norm():
    view = _view(cap=2.5)
    (reply,) = craft("quiet-flip", view)
    np.testing.assert_array_equal(reply.update["w"], -view.own[0]["w"])
    assert reply.update["steps"] == view.own[0]["steps"]
    assert reply.claims == {}


@pytest.mark.parametrize(
    ("attack", "size"),
    [
        # cos 0 with μ at the client's own norm
        ("quiet-orthogonal-flip", lambda own: np.linalg.norm(own)),
        # the sign flip of a client that knows the opposing projection:
        # nothing of it points against μ, as large as the bound allows
        ("orthogonal-flip", lambda own: UNDER_BOUND * 2.5),
    ],
)
def test_orthogonal_flips_are_the_reversed_update_without_the_mean(attack, size):
    view = _view(cap=2.5)
    (reply,) = craft(attack, view)
    sent = reply.update["w"].astype(np.float64)
    own = view.own[0]["w"].astype(np.float64)
    mu = _mu(view)
    # oracle: Gram-Schmidt of -own against mu, rescaled
    expected = -own - (-own @ mu) / (mu @ mu) * mu
    expected *= size(own) / np.linalg.norm(expected)
    np.testing.assert_allclose(sent, expected, rtol=1e-5, atol=1e-6)
    assert abs(sent @ mu) / (np.linalg.norm(sent) * np.linalg.norm(mu)) < 1e-5


@pytest.mark.parametrize("f", [1, 2])
def test_slack_reverse_turns_the_mean_around_just_inside_jensens_check(f):
    """Under SecAgg+ (a claim cap B²): Δ̄ = −0.99·√A·H/‖H‖ with A at its largest.

    Oracle: the weighted sums written out, with the colluders' claims at the
    cap. Without a claim cap (the server computes every norm) it is IPM.
    """
    honest = _honest()
    own = _honest(seed=1, n=f)
    weights = [1.0 + i for i in range(len(honest))] + [2.0] * f
    view = RoundView(honest, own, 5.0, [10.0] * len(honest), seed=3,
                     claim_cap=25.0, weights=weights)  # fmt: skip
    replies = craft("slack-reverse", view)
    omega = np.array(weights) / sum(weights)
    updates = [h["w"].astype(np.float64) for h in honest]
    updates += [r.update["w"].astype(np.float64) for r in replies]
    mean = sum(w * u for w, u in zip(omega, updates, strict=True))
    claims = [float(u @ u) for u in updates[: len(honest)]]
    claims += [r.claims["update-sq-norm"] for r in replies]
    assert claims[-1] == 25.0
    a = float(omega @ np.array(claims))
    h = sum(w * u for w, u in zip(omega, updates[: len(honest)], strict=False))
    np.testing.assert_allclose(
        mean, -UNDER_BOUND * math.sqrt(a) * h / np.linalg.norm(h), rtol=1e-5
    )
    assert float(mean @ mean) <= a  # passes A ≥ ‖Δ̄‖²
    assert all(r.update["steps"] == honest[0]["steps"] for r in replies)
    plain = RoundView(honest, own, 5.0, [10.0] * len(honest), seed=3)
    for got, ipm in zip(
        craft("slack-reverse", plain), craft("ipm", plain), strict=True
    ):
        np.testing.assert_array_equal(got.update["w"], ipm.update["w"])


@pytest.mark.parametrize("attack", ["anchor-inflate", "anchor-deflate"])
def test_anchor_attacks_are_the_sign_flip_outside_the_anchoring_round(attack):
    view = _view(cap=2.5, f=2)
    for mine, flip in zip(craft(attack, view), craft("sign-flip", view), strict=True):
        np.testing.assert_array_equal(mine.update["w"], flip.update["w"])


def test_anchor_inflate_sends_its_reversed_update_above_every_honest_norm():
    plain = _view(cap=2.5, f=2)
    view = RoundView(plain.honest, plain.own, plain.norm_cap, seed=3, anchoring=True)
    top = max(max(norm(h) for h in view.honest), UNDER_BOUND * 2.5)
    for reply, own in zip(craft("anchor-inflate", view), view.own, strict=True):
        sent, mine = reply.update["w"].astype(np.float64), own["w"].astype(np.float64)
        assert norm(reply.update) == pytest.approx(INFLATE_FACTOR * top, rel=1e-5)
        assert sent @ mine / (np.linalg.norm(sent) * np.linalg.norm(mine)) == (
            pytest.approx(-1.0, abs=1e-6)
        )


def test_anchor_deflate_sends_nothing_in_the_anchoring_round():
    plain = _view(cap=2.5, f=2)
    view = RoundView(plain.honest, plain.own, plain.norm_cap, seed=3, anchoring=True)
    for reply in craft("anchor-deflate", view):
        assert norm(reply.update) == 0.0
        assert reply.update["steps"] == 3  # integer arrays as they were


def test_stall_pushes_along_the_mean_at_the_cap_and_claims_no_norm():
    view = _view(cap=2.5, f=2)
    mu = _mu(view)
    for reply in craft("stall", view):
        sent = reply.update["w"].astype(np.float64)
        assert norm(reply.update) == pytest.approx(UNDER_BOUND * 2.5, rel=1e-5)
        assert sent @ mu / (np.linalg.norm(sent) * np.linalg.norm(mu)) == (
            pytest.approx(1.0, abs=1e-6)
        )
        assert reply.claims == {"update-sq-norm": 0.0}


@pytest.mark.parametrize("attack", ["orthogonal", "alie", "ipm", "stall"])
def test_attacks_built_on_the_honest_mean_need_an_honest_update(attack):
    view = RoundView([], _honest(seed=1, n=2), 2.5)
    with pytest.raises(ValueError, match="at least one honest update"):
        craft(attack, view)


def _kept_by(selection, replies, honest, f=1):
    """Whether the defence's own selection (fedadapt's Krum, multi-Krum,
    Bulyan: tested equal to Flower's) keeps every hostile reply."""
    updates = [*honest, *replies]
    stacks = {"w": np.stack([u["w"].astype(np.float64) for u in updates])}
    dist = pairwise_sq_distances(stacks)
    n = len(updates)
    if selection == "bulyan":
        chosen = set(bulyan_select(dist, f))
    else:
        chosen = set(krum_select(dist, f, 1 if selection == "krum" else n - f))
    return all(i in chosen for i in range(len(honest), n))


@pytest.mark.parametrize("selection", ["krum", "multi_krum", "bulyan"])
def test_selected_flip_goes_against_its_update_as_far_as_the_selection_keeps_it(
    selection,
):
    """After Fang et al. (2020), against a selection: μ + λ·u, u = −Δ_own
    normalised, λ as large as the aggregator still keeps it. The defence's
    own selection is the oracle: kept as sent, dropped 5 % further along u
    (where the bound allowed it)."""
    honest = _honest(n=9)
    own = _honest(seed=1, n=1)
    cap = 3 * max(norm(h) for h in honest)
    view = RoundView(honest, own, cap, [10.0] * 9, seed=3, selection=selection)
    (reply,) = craft("selected-flip", view)
    mu = _mu(view)
    push = reply.update["w"].astype(np.float64) - mu
    mine = own[0]["w"].astype(np.float64)
    assert np.linalg.norm(push) > 0 and norm(reply.update) < UNDER_BOUND * cap
    cosine = push @ mine / (np.linalg.norm(push) * np.linalg.norm(mine))
    assert cosine == pytest.approx(-1, abs=1e-5)
    assert reply.update["steps"] == own[0]["steps"]
    assert _kept_by(selection, [reply.update], honest)
    further = {"w": (mu + 1.05 * push).astype(np.float32)}
    assert not _kept_by(selection, [further], honest)
    # no selection in force: the sign flip at the bound
    plain = RoundView(honest, own, cap, [10.0] * 9, seed=3)
    (flip,) = craft("selected-flip", plain)
    assert norm(flip.update) == pytest.approx(UNDER_BOUND * cap, rel=1e-5)


@pytest.mark.parametrize("selection", ["krum", "multi_krum", "bulyan"])
def test_selected_ipm_goes_against_the_mean_as_far_as_the_selection_keeps_it(
    selection,
):
    """Inner-product manipulation kept by the selection: μ − λ·μ/‖μ‖, λ as
    large as the aggregator keeps it (the defence's own selection is the
    oracle); every colluder sends the same; no selection in force: ipm."""
    f = 1 if selection == "krum" else 2  # Krum keeps one reply
    honest = _honest(n=9)
    own = _honest(seed=1, n=f)
    cap = 3 * max(norm(h) for h in honest)
    view = RoundView(honest, own, cap, [10.0] * 9, seed=3, selection=selection,
                     assumed_hostile=f)  # fmt: skip
    replies = craft("selected-ipm", view)
    mu = _mu(view)
    push = replies[0].update["w"].astype(np.float64) - mu
    cosine = push @ mu / (np.linalg.norm(push) * np.linalg.norm(mu))
    assert np.linalg.norm(push) > 0 and cosine == pytest.approx(-1, abs=1e-5)
    for reply in replies[1:]:
        np.testing.assert_array_equal(reply.update["w"], replies[0].update["w"])
    assert _kept_by(selection, [r.update for r in replies], honest, f=f)
    further = {"w": (mu + 1.05 * push).astype(np.float32)}
    assert not _kept_by(selection, [further] * f, honest, f=f)
    plain = RoundView(honest, own, cap, [10.0] * 9, seed=3)
    for got, want in zip(craft("selected-ipm", plain), craft("ipm", plain),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got.update["w"], want.update["w"])


def test_selected_flip_judges_a_short_round_with_the_f_the_aggregator_uses():
    """Bulyan with f = 1 needs 7 replies; with 5 the aggregator uses f = 0
    (``usable_hostile``), and the attack is kept by that selection; with
    two replies (the median) it is the sign flip; with no honest update it
    says so."""
    honest = _honest(n=4)
    own = _honest(seed=1, n=1)
    view = RoundView(honest, own, 10.0, [10.0] * 4, seed=3, selection="bulyan")
    (reply,) = craft("selected-flip", view)
    assert _kept_by("bulyan", [reply.update], honest, f=0)
    lone = RoundView(honest[:1], own, 2.5, [10.0], seed=3, selection="bulyan")
    (flip,) = craft("selected-flip", lone)
    assert norm(flip.update) == pytest.approx(UNDER_BOUND * 2.5, rel=1e-5)
    with pytest.raises(ValueError, match="at least one honest update"):
        craft("selected-flip", RoundView([], own, 2.5, selection="krum"))


def test_selected_flip_colluders_are_all_kept_by_the_f_it_assumes():
    honest = _honest(n=8)
    own = _honest(seed=1, n=2)
    view = RoundView(honest, own, 10.0, [10.0] * 8, seed=3,
                     selection="multi_krum", assumed_hostile=2)  # fmt: skip
    replies = craft("selected-flip", view)
    assert len(replies) == 2
    assert _kept_by("multi_krum", [r.update for r in replies], honest, f=2)
    assert all(np.linalg.norm(r.update["w"] - _mu(view)) > 0 for r in replies)


def _cc_output(replies, center, tau):
    """Centered clipping's v_1 (one iteration, fixed τ) over ``replies``' "w"."""
    stack = np.stack([r["w"].astype(np.float64) for r in replies])
    return centered_clipping({"w": stack}, {"w": center}, tau, 1).update["w"]


def test_centered_flip_pushes_against_the_mean_as_far_as_clipping_allows():
    # Prepare: a centre near the honest mean (the last round's Δ̄), a cap
    honest = _honest()
    mu = np.mean([h["w"].astype(np.float64) for h in honest], axis=0)
    center = (0.8 * mu + 0.1 * np.random.default_rng(5).normal(size=mu.size)).astype(
        np.float32
    )
    cap, tau = 2.5, 0.5
    view = RoundView(honest, _honest(seed=1, n=1), cap, [10.0] * len(honest),
                     seed=3, center={"w": center})  # fmt: skip
    # Execute
    (reply,) = craft("centered-flip", view)
    # Assert: on the ray from v against μ, at the target norm
    sent = reply.update["w"].astype(np.float64)
    away = sent - center
    unit = -mu / np.linalg.norm(mu)
    assert away @ unit / np.linalg.norm(away) == pytest.approx(1.0, abs=1e-6)
    assert norm(reply.update) == pytest.approx(UNDER_BOUND * cap, rel=1e-5)
    assert reply.update["steps"] == view.own[0]["steps"]
    # ... so clipping (the aggregator's own code, τ below its distance)
    # leaves it τ/n along −μ: against a reply at v itself (no push) ...
    n = len(honest) + 1
    silent = {"w": center.copy()}
    shift = _cc_output([*honest, reply.update], center, tau) - _cc_output(
        [*honest, silent], center, tau
    )
    np.testing.assert_allclose(shift, tau / n * unit, atol=1e-6)
    # ... and no other attack at the same cap pushes CC's output further
    # against μ
    push = _cc_output([*honest, reply.update], center, tau) @ unit
    for other in ("sign-flip", "ipm", "orthogonal", "orthogonal-flip", "scaled-copy"):
        (alt,) = craft(other, view)
        assert _cc_output([*honest, alt.update], center, tau) @ unit <= push + 1e-9


def test_centered_flip_is_the_sign_flip_without_centered_clipping():
    view = _view(cap=2.0)
    (flip,) = craft("sign-flip", view)
    (reply,) = craft("centered-flip", view)
    np.testing.assert_array_equal(reply.update["w"], flip.update["w"])


@pytest.mark.parametrize("aggregator", ["trimmed_mean", "median"])
def test_coordinate_flip_moves_every_coordinate_as_far_against_the_mean_as_any_reply(
    aggregator,
):
    """Fang et al. 2020's attack on the coordinate-wise aggregators, judged
    with the library's own ``robust_mean``: both are monotone in each value,
    so no reply at all (the suite's other attacks, random ones) moves any
    coordinate of the aggregate further against μ."""
    from fedadapt.strategies.core.aggregation import robust_mean

    # Prepare: nine honest updates, a cap loose enough not to bind
    honest = _honest(n=9)
    mu = _mu(RoundView(honest, _honest(seed=1, n=1)))
    view = RoundView(honest, _honest(seed=1, n=1), 50.0, [10.0] * 9, seed=3,
                     coordinate_wise=True)  # fmt: skip

    def against_mu(reply):
        stack = np.stack([u["w"].astype(np.float64) for u in [*honest, reply]])
        return robust_mean(stack, aggregator, 0.2) * -np.sign(mu)

    # Execute
    (reply,) = craft("coordinate-flip", view)
    # Assert: each coordinate is the honest extreme on the side against μ_j
    stack = np.stack([h["w"] for h in honest])
    np.testing.assert_array_equal(
        reply.update["w"], np.where(mu > 0, stack.min(axis=0), stack.max(axis=0))
    )
    assert reply.update["steps"] == honest[0]["steps"]
    best = against_mu(reply.update)
    rng = np.random.default_rng(0)
    others = [
        craft(a, view)[0].update
        for a in ("sign-flip", "ipm", "alie", "orthogonal", "orthogonal-flip")
    ]
    others += [{"w": (10 * rng.normal(size=mu.size)).astype(np.float32)}
               for _ in range(20)]  # fmt: skip
    for other in others:
        assert np.all(against_mu(other) <= best + 1e-6)
    # ... and it moves the aggregate against μ, against a reply at μ itself
    silent = {"w": mu.astype(np.float32)}
    assert np.all(best >= against_mu(silent) - 1e-6)
    assert np.any(best > against_mu(silent) + 1e-4)


def test_coordinate_flip_keeps_to_the_cap_and_is_the_sign_flip_elsewhere():
    view = _view(cap=0.5)
    capped = RoundView(view.honest, view.own, 0.5, [10.0] * 7, seed=3,
                       coordinate_wise=True)  # fmt: skip
    (reply,) = craft("coordinate-flip", capped)
    assert norm(reply.update) == pytest.approx(UNDER_BOUND * 0.5, rel=1e-5)
    (flip,) = craft("sign-flip", view)
    (plain,) = craft("coordinate-flip", view)
    np.testing.assert_array_equal(plain.update["w"], flip.update["w"])
