"""Hostile clients: the attacks the robustness suite runs against every defence.

Plain NumPy over a round's updates Δ_i = x_i − x_t (dicts of arrays, as the
server's aggregation sees them), so a test harness, a benchmark or a user's
own evaluation can build a hostile reply from honest ones. Definitions:
``algorithms-spec.md`` §12 and the papers named per attack.

The attacker is the strongest the literature considers: it knows every
honest update of the round (ALIE and IPM assume so) and the defence in
force, and it keeps each update's norm just under the bound the defence
would clip at (``norm_cap``, :func:`norm_target`). With several hostile
clients they collude: all send the same crafted update (as in Baruch et al.
and Xie et al.), except the data-poisoning and scaled-copy attacks, where
each starts from its own update.

Every attack returns, per hostile client, the update it sends and the
metrics it *claims* on top of the honest ones (a false ``update-sq-norm`` or
``num-examples``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedadapt.strategies.core.robust import (
    DEFAULT_NUM_HOSTILE,
    bulyan_select,
    krum_select,
    usable_hostile,
)

Arrays = dict[str, NDArray[Any]]

#: The attacks, in the suite's order (``label-flip`` poisons the training
#: data: its update is whatever honest training on flipped labels gives).
ATTACKS = (
    "sign-flip",
    "orthogonal",
    "alie",
    "ipm",
    "scaled-copy",
    "false-norm",
    "false-weight",
    "label-flip",
    "quiet-flip",
    "quiet-orthogonal-flip",
    "orthogonal-flip",
    "slack-reverse",
    "anchor-inflate",
    "anchor-deflate",
    "stall",
    "selected-flip",
    "selected-ipm",
    "centered-flip",
    "coordinate-flip",
)

#: Without a norm bound, how many times its own honest norm an attacker
#: sends (the ×4 that issue #38 measured: below the old 5× flag).
UNBOUNDED_SCALE = 4.0

#: How close to the bound an attacker goes (just under: never clipped).
UNDER_BOUND = 0.99

#: Factor of a false report (``false-norm``: claimed ‖Δ‖²; ``false-weight``:
#: claimed examples against the largest honest count).
FALSE_REPORT_FACTOR = 100.0

#: ``anchor-inflate``: the norm it sends in the anchoring round, as a
#: multiple of the largest honest norm (above every honest one, so the
#: round's median rises by as many ranks as there are colluders).
INFLATE_FACTOR = 10.0


@dataclass(frozen=True)
class RoundView:
    """What a hostile client knows of a round.

    Attributes
    ----------
    honest : sequence of Arrays
        The honest clients' updates Δ_j of this round.
    own : sequence of Arrays
        Each hostile client's own honest update (what it would have sent).
    norm_cap : float
        The largest ‖Δ‖ the defence in force leaves untouched (``inf`` when
        it bounds no norm; see :func:`norm_target`).
    honest_examples : sequence of float
        The honest clients' ``num-examples``.
    seed : int
        Seed of any random direction.
    claim_cap : float
        The largest ‖Δ‖² a client's norm report can carry to the server
        (``inf`` where the server computes each norm itself; under SecAgg+
        the top of the norm entry's range, B_t²).
    weights : sequence of float
        The aggregation weight of every reply, the honest ones first, then
        the hostile ones (empty: equal weights).
    weight_cap : float
        The most ``num-examples`` the server accepts without failing the
        round (``inf``: none, or the server caps it itself; under SecAgg+
        the cap it sends).
    anchoring : bool
        Whether this round's median update norm becomes the anchor of the
        server's norm ceiling (``max_norm_growth``: the ceiling is on and
        has no anchor yet), which ``anchor-inflate`` and ``anchor-deflate``
        exploit.
    selection : str | None
        The robust aggregator in force that keeps some replies whole and
        drops the others (``"krum"``, ``"multi_krum"``, ``"bulyan"``:
        :data:`~fedadapt.strategies.core.robust.SELECTIONS`), with the f it
        assumes (``assumed_hostile``) and multi-Krum's ``krum_keep`` (0:
        n − f); None for every other aggregation. ``selected-flip`` uses it.
    center : mapping of str to array, or None
        v, the centre centered clipping measures each update's distance
        from (the previous round's Δ̄; an array it lacks is zero, as in the
        first round) when that aggregator is in force; None otherwise.
        ``centered-flip`` uses it.
    coordinate_wise : bool
        Whether the aggregator in force is coordinate-wise (the median or
        the trimmed mean), which ``coordinate-flip`` exploits.
    """

    honest: Sequence[Mapping[str, NDArray[Any]]]
    own: Sequence[Mapping[str, NDArray[Any]]]
    norm_cap: float = math.inf
    honest_examples: Sequence[float] = field(default_factory=tuple)
    seed: int = 0
    claim_cap: float = math.inf
    weights: Sequence[float] = field(default_factory=tuple)
    weight_cap: float = math.inf
    anchoring: bool = False
    selection: str | None = None
    assumed_hostile: int = DEFAULT_NUM_HOSTILE
    krum_keep: int = 0
    center: Mapping[str, NDArray[Any]] | None = None
    coordinate_wise: bool = False

    @property
    def num_clients(self) -> int:
        """n: honest and hostile replies of the round."""
        return len(self.honest) + len(self.own)

    @property
    def num_hostile(self) -> int:
        """f: the hostile replies."""
        return len(self.own)


@dataclass(frozen=True)
class HostileReply:
    """One hostile client's reply: its update and the metrics it claims."""

    update: Arrays
    claims: dict[str, float] = field(default_factory=dict)


def _float_keys(arrays: Mapping[str, NDArray[Any]]) -> list[str]:
    return [k for k, a in arrays.items() if a.dtype.kind == "f"]


def norm(arrays: Mapping[str, NDArray[Any]]) -> float:
    """Return ‖Δ‖ over the floating-point arrays (float64 accumulation)."""
    return math.sqrt(
        math.fsum(float(np.vdot(arrays[k], arrays[k])) for k in _float_keys(arrays))
    )


def _scaled(arrays: Mapping[str, NDArray[Any]], factor: float) -> Arrays:
    """Float arrays times ``factor``; others (BN step counters) as they are."""
    return {
        k: (a * factor).astype(a.dtype) if a.dtype.kind == "f" else a.copy()
        for k, a in arrays.items()
    }


def _with_norm(arrays: Mapping[str, NDArray[Any]], target: float) -> Arrays:
    current = norm(arrays)
    return _scaled(arrays, target / current if current > 0 else 0.0)


def honest_mean(view: RoundView) -> Arrays:
    """μ: the coordinate-wise mean of the honest updates."""
    first = view.honest[0]
    return {
        k: np.mean([h[k] for h in view.honest], axis=0).astype(first[k].dtype)
        for k in first
    }


def norm_target(view: RoundView, own: Mapping[str, NDArray[Any]]) -> float:
    """Return the norm a hostile update is sent at: just under the cap, if any.

    ``UNDER_BOUND`` × ``norm_cap`` when the defence bounds norms; otherwise
    ``UNBOUNDED_SCALE`` × the client's own honest norm.
    """
    if math.isfinite(view.norm_cap):
        return UNDER_BOUND * view.norm_cap
    return UNBOUNDED_SCALE * norm(own)


def alie_z(num_clients: int, num_hostile: int) -> float:
    """z_max of "A little is enough" (Baruch et al., NeurIPS 2019, §3).

    s = ⌊n/2 + 1⌋ − f supporters are needed; z_max = Φ⁻¹((n − s)/n). With
    one hostile client of ten z_max is 0: the attack sends the honest mean.
    """
    supporters = math.floor(num_clients / 2 + 1) - num_hostile
    quantile = (num_clients - supporters) / num_clients
    quantile = min(max(quantile, 1e-6), 1 - 1e-6)
    return NormalDist().inv_cdf(quantile)


def craft(attack: str, view: RoundView) -> list[HostileReply]:
    """Return one :class:`HostileReply` per hostile client for ``attack``.

    - ``sign-flip``: −c·Δ_own with ‖·‖ at :func:`norm_target`.
    - ``orthogonal``: a random direction orthogonal to μ, at the target norm.
    - ``alie``: μ − z·σ per coordinate (:func:`alie_z`, Baruch et al. 2019).
    - ``ipm``: −ε·μ with ε as large as the target norm allows (inner-product
      manipulation, Xie, Koyejo, Gupta, UAI 2019).
    - ``scaled-copy``: the client's own honest update scaled up to the
      target norm (never down): a plausible update that weighs more.
    - ``false-norm``: the honest update, with ``update-sq-norm`` claimed
      ``FALSE_REPORT_FACTOR`` times too large (inflates A where reports are
      trusted).
    - ``false-weight``: the sign flip, claiming ``FALSE_REPORT_FACTOR``
      times the largest honest ``num-examples`` (at most ``weight_cap``).
    - ``label-flip``: the update honest training on labels y → C−1−y gave
      (the caller trains so; the update is sent as it is).
    - ``quiet-flip``: −Δ_own at the client's *own* honest norm, with its
      true weight: nothing a norm bound or a weight cap can tell from an
      honest reply (no defence that leaves honest norms and weights alone
      can act on it; it measures what is left once those defences hold).
    - ``quiet-orthogonal-flip``: −Δ_own without its component along μ, at
      its own norm: cos(update, μ) = 0, so a defence that drops updates
      pointing against the others' mean does not see it either; what is
      left is the client-specific (on non-IID data: class-specific) part
      reversed.
    - ``orthogonal-flip``: the same at the target norm (the bound): the sign
      flip of an attacker that knows the opposing projection
      (:func:`~fedadapt.strategies.core.aggregation.opposing_projection`)
      and sends only what it leaves, as large as the norm bound allows.
    - ``slack-reverse`` (against SecAgg+, where the server sees only Δ̄
      and A): the colluders claim the largest norm the range allows
      (``claim_cap``) and send the update that turns Δ̄ against the honest
      contribution with ‖Δ̄‖² just under A (:func:`_slack_reverse`), the
      most that Jensen's check A ≥ ‖Δ̄‖² lets through. Where the server
      computes every norm (``claim_cap`` infinite) it is ``ipm``.
    - ``anchor-inflate`` (against the norm ceiling, which is g times the
      median norm of the round that anchors it): in that round the
      colluders send their reversed updates at ``INFLATE_FACTOR`` times the
      largest honest norm, above every honest one (the round's own norm
      bound clips them as it clips any update), so the anchor is the median
      moved up by f ranks and every later ceiling is that much higher; then
      ``sign-flip`` at the (raised) bound.
    - ``anchor-deflate``: in the anchoring round the colluders send zero
      updates, moving the median down by f ranks, so that the ceiling clips
      the honest clients' later updates sooner; then ``sign-flip``.
    Outside the anchoring round (``view.anchoring`` false, or no ceiling)
    both are ``sign-flip``.
    - ``selected-flip`` (against Krum, multi-Krum and Bulyan, which drop
      the replies farthest from the others): μ + λ·u, u the colluder's
      reversed direction −Δ_own/‖Δ_own‖, with the largest λ (up to the
      target norm) at which the aggregator in force (``selection``) still
      keeps every colluder (:func:`_selected_flip`; after Fang, Cao, Jia,
      Gong, USENIX Security 2020, "Local Model Poisoning Attacks to
      Byzantine-Robust Federated Learning", §3, the largest λ the
      selection accepts). The honest mean is the most central reply of a
      round, so it is kept, and an honest one is dropped in its place.
      Elsewhere it is ``sign-flip``.
    - ``selected-ipm`` (against the step guard under multi-Krum): the same
      with u = −μ/‖μ‖ for every colluder, inner-product manipulation (Xie,
      Koyejo, Gupta 2019) as far as the selection keeps it. Kept, it
      shortens Δ̄ by λ/n along μ while its ‖Δ_i‖² stays near the honest
      ones: it raises FedExP's and FedDuA's step A/(2‖Δ̄‖²) (in the unit
      harness 1.7–1.9× the honest clients' own; the step guard does not
      act under multi-Krum), where a direction orthogonal to μ, which adds
      to A instead, raised it by nothing: the selection keeps no reply
      much longer than the honest ones. Colluders send the same point, so
      each supports the others' Krum scores. Elsewhere it is ``ipm``.
    - ``centered-flip`` (against centered clipping, which clips each
      update's distance from the centre v to τ): v + R·u with u = −μ/‖μ‖
      and R as large as the target norm allows (:func:`_centered_flip`).
      Clipped to τ, its displacement is τ·u: the largest push against the
      honest mean that clipping lets one reply make (Karimireddy, He,
      Jaggi 2021 bound each reply's effect by τ/n; this reply reaches the
      bound along −μ, where a sign flip reaches it along its own reversed
      update less v). Elsewhere (``center`` None) it is ``sign-flip``.
    - ``coordinate-flip`` (against the coordinate-wise median and trimmed
      mean): in each coordinate j the honest extreme on the side against
      μ_j, min_h Δ_hj where μ_j > 0 and max_h Δ_hj elsewhere, the whole
      held to the target norm (:func:`_coordinate_flip`; Fang, Cao, Jia,
      Gong, USENIX Security 2020, §4, the full-knowledge attack on the
      trimmed mean and the median, which samples beyond the extreme: both
      aggregators are monotone in each value and a value past the extreme
      counts as the extreme, so the extreme itself moves each coordinate
      as far as any value can, at the smallest norm). Elsewhere
      (``coordinate_wise`` false) it is ``sign-flip``.
    - ``stall`` (a liveness attack on SecAgg+'s check of the sums): the
      honest mean scaled to the target norm, claiming ‖Δ‖² = 0. Under
      SecAgg+ the decoded A then falls short of ‖Δ̄‖² where the honest
      clients agree closely, and the server refuses the round without
      knowing who caused it. Where the server computes every norm the
      claim is a counted mismatch and the update a push along μ.
    """
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; choose from {ATTACKS}")
    if not view.own:
        return []
    if not view.honest and attack in ("orthogonal", "alie", "ipm", "stall"):
        raise ValueError(f"{attack} needs at least one honest update")
    if attack == "sign-flip":
        return [HostileReply(_with_norm(_scaled(o, -1.0), norm_target(view, o)))
                for o in view.own]  # fmt: skip
    if attack == "orthogonal":
        return _same_for_all(view, _orthogonal(view))
    if attack == "alie":
        return _same_for_all(view, _alie(view))
    if attack == "ipm":
        mu = honest_mean(view)
        return _same_for_all(view, _with_norm(_scaled(mu, -1.0), _target(view)))
    if attack == "scaled-copy":
        return [HostileReply(_scaled(o, _up_to_target(view, o))) for o in view.own]
    if attack == "false-norm":
        return [HostileReply(_scaled(o, 1.0),
                             {"update-sq-norm": FALSE_REPORT_FACTOR * norm(o) ** 2})
                for o in view.own]  # fmt: skip
    if attack == "false-weight":
        claim = FALSE_REPORT_FACTOR * max(view.honest_examples or (1.0,))
        claim = min(claim, view.weight_cap)
        flipped = craft("sign-flip", view)
        return [HostileReply(r.update, {"num-examples": claim}) for r in flipped]
    if attack == "quiet-flip":
        return [HostileReply(_scaled(o, -1.0)) for o in view.own]
    if attack == "quiet-orthogonal-flip":
        return [HostileReply(_with_norm(_without_mean(view, _scaled(o, -1.0)),
                                        norm(o)))
                for o in view.own]  # fmt: skip
    if attack == "orthogonal-flip":
        return [HostileReply(_with_norm(_without_mean(view, _scaled(o, -1.0)),
                                        norm_target(view, o)))
                for o in view.own]  # fmt: skip
    if attack in ("anchor-inflate", "anchor-deflate") and view.anchoring:
        if attack == "anchor-deflate":
            return [HostileReply(_scaled(o, 0.0)) for o in view.own]
        top = max([norm(h) for h in view.honest] + [norm_target(view, o)
                                                    for o in view.own])  # fmt: skip
        return [HostileReply(_with_norm(_scaled(o, -1.0), INFLATE_FACTOR * top))
                for o in view.own]  # fmt: skip
    if attack in ("anchor-inflate", "anchor-deflate"):
        return craft("sign-flip", view)
    if attack in ("selected-flip", "selected-ipm"):
        if view.selection is None:
            return craft("sign-flip" if attack == "selected-flip" else "ipm", view)
        if not view.honest:
            raise ValueError(f"{attack} needs at least one honest update")
        push = _selected_flip if attack == "selected-flip" else _selected_ipm
        return [HostileReply(u) for u in push(view)]
    if attack == "centered-flip":
        if view.center is None:
            return craft("sign-flip", view)
        if not view.honest:
            raise ValueError(f"{attack} needs at least one honest update")
        return [HostileReply(_centered_flip(view, o)) for o in view.own]
    if attack == "coordinate-flip":
        if not view.coordinate_wise:
            return craft("sign-flip", view)
        if not view.honest:
            raise ValueError(f"{attack} needs at least one honest update")
        return _same_for_all(view, _coordinate_flip(view))
    if attack == "stall":
        along = _with_norm(honest_mean(view), _target(view))
        return _same_for_all(view, along, {"update-sq-norm": 0.0})
    if attack == "slack-reverse":
        if not math.isfinite(view.claim_cap):
            return craft("ipm", view)
        return _same_for_all(
            view, _slack_reverse(view), {"update-sq-norm": view.claim_cap}
        )
    return [HostileReply(_scaled(o, 1.0)) for o in view.own]  # label-flip


def _up_to_target(view: RoundView, own: Mapping[str, NDArray[Any]]) -> float:
    """Return the factor that scales ``own`` up to its target norm (≥ 1)."""
    return max(1.0, norm_target(view, own) / max(norm(own), 1e-30))


def _target(view: RoundView) -> float:
    """Return the colluders' common norm: the smallest of their targets."""
    return min(norm_target(view, o) for o in view.own)


def _same_for_all(
    view: RoundView, update: Arrays, claims: Mapping[str, float] | None = None
) -> list[HostileReply]:
    return [
        HostileReply({k: a.copy() for k, a in update.items()}, dict(claims or {}))
        for _ in view.own
    ]


def _without_mean(view: RoundView, arrays: Mapping[str, NDArray[Any]]) -> Arrays:
    """Return ``arrays`` minus their component along μ (float arrays; float64).

    Other arrays (integer step counters) are taken from μ.
    """
    mu = honest_mean(view)
    keys = _float_keys(mu)
    vec = {k: np.asarray(arrays[k], dtype=np.float64) for k in keys}
    mu_sq = sum(float(np.vdot(mu[k], mu[k])) for k in keys)
    if mu_sq > 0:
        along = sum(float(np.vdot(vec[k], mu[k])) for k in keys) / mu_sq
        vec = {k: vec[k] - along * mu[k] for k in keys}
    return {k: vec[k].astype(mu[k].dtype) if k in vec else mu[k].copy() for k in mu}


def _orthogonal(view: RoundView) -> Arrays:
    """Return a Gaussian direction without its μ component, at the target norm."""
    rng = np.random.default_rng(view.seed)
    mu = honest_mean(view)
    noise = {k: rng.standard_normal(a.shape) if a.dtype.kind == "f" else a
             for k, a in mu.items()}  # fmt: skip
    return _with_norm(_without_mean(view, noise), _target(view))


def _alie(view: RoundView) -> Arrays:
    """μ − z_max·σ per coordinate over the honest updates."""
    z = alie_z(view.num_clients, view.num_hostile)
    first = view.honest[0]
    out: Arrays = {}
    for k, a in first.items():
        stack = np.stack([np.asarray(h[k], dtype=np.float64) for h in view.honest])
        value = stack.mean(axis=0)
        if a.dtype.kind == "f":
            value = value - z * stack.std(axis=0)
        out[k] = value.astype(a.dtype)
    return out


def _coordinate_flip(view: RoundView) -> Arrays:
    """Return each coordinate's honest extreme against μ, within the target.

    min_h Δ_hj where μ_j > 0, max_h Δ_hj elsewhere (float arrays; others
    from μ), scaled down to the colluders' common target norm if above it.
    """
    mu = honest_mean(view)
    out: Arrays = {}
    for k, m in mu.items():
        if m.dtype.kind != "f":
            out[k] = m.copy()
            continue
        stack = np.stack([np.asarray(h[k]) for h in view.honest])
        out[k] = np.where(m > 0, stack.min(axis=0), stack.max(axis=0)).astype(m.dtype)
    target = _target(view)
    return out if norm(out) <= target else _with_norm(out, target)


def _slack_reverse(view: RoundView) -> Arrays:
    """Return the colluders' common update that reverses Δ̄ within Jensen's slack.

    With weights ω (summing to 1), the honest contribution H = Σ_h ω_h Δ_h,
    A = Σ_h ω_h‖Δ_h‖² + ω_f·``claim_cap`` (ω_f the colluders' share, each
    claiming the cap) and target Δ̄* = −s·H/‖H‖ with s = ``UNDER_BOUND``·√A,
    every colluder sends (Δ̄* − H)/ω_f, so that Δ̄ = Δ̄* and ‖Δ̄‖² ≈ 0.98·A
    passes the server's check A ≥ ‖Δ̄‖². Its own size is ‖Δ̄* − H‖/ω_f,
    about √A/ω_f: ten times a typical update for one client of ten, which
    no check on the sums can see.
    """
    weights = list(view.weights) or [1.0] * view.num_clients
    total = float(sum(weights))
    honest_w = [w / total for w in weights[: len(view.honest)]]
    hostile_share = sum(weights[len(view.honest) :]) / total
    first = view.honest[0]
    keys = _float_keys(first)
    contribution: dict[str, NDArray[np.float64]] = {
        k: np.sum(
            [
                w * np.asarray(h[k], np.float64)
                for w, h in zip(honest_w, view.honest, strict=True)
            ],
            axis=0,
        )
        for k in keys
    }
    honest_a = math.fsum(
        w * norm(h) ** 2 for w, h in zip(honest_w, view.honest, strict=True)
    )
    size = UNDER_BOUND * math.sqrt(honest_a + hostile_share * view.claim_cap)
    length = math.sqrt(math.fsum(float(np.vdot(v, v)) for v in contribution.values()))
    direction: Mapping[str, NDArray[Any]]
    if length > 0:
        direction = {k: -v / length for k, v in contribution.items()}
    else:  # nothing to reverse: push against the colluders' own updates
        direction = _with_norm(_scaled(view.own[0], -1.0), 1.0)
    mean = honest_mean(view)
    return {
        k: ((size * direction[k] - contribution[k]) / hostile_share).astype(
            first[k].dtype
        )
        if k in contribution
        else mean[k].copy()
        for k in first
    }


#: Halvings of the search for the largest kept norm (``selected-flip``).
SELECTION_SEARCH_STEPS = 30


def _centered_flip(view: RoundView, own: Mapping[str, NDArray[Any]]) -> Arrays:
    """Return v + R·u, u = −μ/‖μ‖, R the largest with ‖v + R·u‖ = the target.

    R = −⟨v, u⟩ + √(⟨v, u⟩² − ‖v‖² + t²) for t = :func:`norm_target`
    (``UNDER_BOUND`` × the norm cap). Where no point of that ray is within
    t of the origin, its point nearest the origin scaled to t; where μ = 0,
    the sign flip. Integer arrays are the client's own.
    """
    assert view.center is not None, "craft() sends the sign flip without one"
    mu = honest_mean(view)
    length = norm(mu)
    if length == 0:
        return craft("sign-flip", replace(view, own=[own]))[0].update
    keys = _float_keys(mu)
    u = {k: -np.asarray(mu[k], np.float64) / length for k in keys}
    v = {
        k: np.asarray(view.center[k], np.float64).reshape(mu[k].shape)
        if k in view.center
        else np.zeros(mu[k].shape)
        for k in keys
    }
    along = math.fsum(float(np.vdot(v[k], u[k])) for k in keys)
    centre_sq = math.fsum(float(np.vdot(v[k], v[k])) for k in keys)
    target = norm_target(view, own)
    room = along * along - centre_sq + target * target
    reach = -along + math.sqrt(room) if room >= 0 else max(0.0, -along)
    point = {k: v[k] + reach * u[k] for k in keys}
    if room < 0:
        point = _with_norm(point, target)
    return {
        k: np.asarray(point[k]).astype(mu[k].dtype) if k in keys else own[k].copy()
        for k in mu
    }


def _selected_flip(view: RoundView) -> list[Arrays]:
    """``selected-flip``: :func:`_selected_push` along −Δ_own/‖Δ_own‖."""
    return _selected_push(view, [_with_norm(_scaled(o, -1.0), 1.0) for o in view.own])


def _selected_ipm(view: RoundView) -> list[Arrays]:
    """``selected-ipm``: :func:`_selected_push` along −μ/‖μ‖, every colluder."""
    against = _with_norm(_scaled(honest_mean(view), -1.0), 1.0)
    return _selected_push(view, [against] * len(view.own))


def _selected_push(view: RoundView, units: Sequence[Arrays]) -> list[Arrays]:
    """Return μ + λ·u_i for each colluder, λ the largest still kept.

    u_i a unit direction per colluder (``selected-flip``: its reversed
    update; ``selected-ipm``: −μ/‖μ‖); each reply is
    held to its :func:`norm_target` (λ_i = min(λ, the λ at which
    ‖μ + λu_i‖ reaches it)). λ is the largest (bisection,
    :data:`SELECTION_SEARCH_STEPS` halvings) at which ``view.selection``
    with f = ``assumed_hostile`` keeps every colluder, computed from the
    Gram matrix of the honest updates, μ and the u_i (the aggregator's own
    distances, over every float array). Starting from μ, the most central
    point of the round, rather than from 0 (Fang et al.'s reference
    model): it is kept at λ = 0 whether the honest updates agree or not.
    The λ sent is ``UNDER_BOUND`` times the largest kept (just inside, as
    under a norm bound). No λ > 0 kept: μ (``alie`` with z = 0). A round
    with too few replies for f is judged with the f the aggregator then
    uses (:func:`~fedadapt.strategies.core.robust.usable_hostile`); under
    three replies, where it takes the median, the sign flip.
    """
    selection = view.selection
    assert selection is not None, "craft() sends the sign flip without one"
    mu = honest_mean(view)
    keys = _float_keys(mu)
    basis = np.array([
        np.concatenate([np.asarray(r[k], np.float64).ravel() for k in keys])
        for r in [*view.honest, mu, *units]
    ])  # fmt: skip
    gram = basis @ basis.T
    honest, f = len(view.honest), len(units)
    n = honest + f
    m_u = gram[honest, honest + 1 :]  # μ·u_i
    reach = [
        max(0.0, -b + math.sqrt(max(b * b - gram[honest, honest] + t * t, 0.0)))
        for b, t in zip(m_u, (norm_target(view, o) for o in view.own), strict=True)
    ]  # the λ at which ‖μ + λu_i‖ = target (0 if μ alone exceeds it)
    # the f the aggregator uses for a round of n replies (robust_statistics)
    assumed = usable_hostile(selection, n, view.assumed_hostile)
    if assumed is None:  # under 3 replies it takes the median: nothing to evade
        return [r.update for r in craft("sign-flip", view)]
    keep = 1 if selection == "krum" else view.krum_keep or n - assumed

    def replies(lam: float) -> NDArray[np.float64]:
        coefficients = np.zeros((n, len(basis)))
        coefficients[:honest, :honest] = np.eye(honest)
        coefficients[honest:, honest] = 1.0
        for i, top in enumerate(reach):
            coefficients[honest + i, honest + 1 + i] = min(lam, top)
        return coefficients

    def kept(lam: float) -> bool:
        c = replies(lam)
        inner = c @ gram @ c.T
        diag = np.diag(inner)
        dist = np.maximum(diag[:, None] + diag[None, :] - 2 * inner, 0.0)
        if selection == "bulyan":
            chosen = set(bulyan_select(dist, assumed))
        else:
            chosen = set(krum_select(dist, assumed, min(keep, n - assumed)))
        return all(i in chosen for i in range(honest, n))

    low, high = 0.0, max(reach)
    if kept(high):
        low = high
    else:
        for _ in range(SELECTION_SEARCH_STEPS):
            middle = 0.5 * (low + high)
            low, high = (middle, high) if kept(middle) else (low, middle)
    low *= UNDER_BOUND  # just inside, as under a norm bound
    return [
        {
            k: (mu[k] + min(low, top) * u[k]).astype(mu[k].dtype)
            if k in keys
            else view.own[i][k].copy()
            for k in mu
        }
        for i, (u, top) in enumerate(zip(units, reach, strict=True))
    ]
