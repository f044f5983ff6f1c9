"""A round's statistics and their application: the server side of every rule.

Every rule sees one round through the same two numbers a secure-aggregation
protocol could reveal (FedDuA, Takakura et al., Algorithm 1 lines 9 and 12;
FedExP, arXiv:2301.09604, Algorithm 1):

    Δ̄_t = Σ_i ω_i Δ_i ,   A_t = Σ_i ω_i ‖Δ_i‖² ,   Δ_i = x_i − x_t

with ω_i uniform over the participants or proportional to ``num-examples``.
:func:`round_statistics` forms them from client arrays (with the server's
own norms, optional clipping and robust aggregation); :func:`apply_statistics`
hands their *adaptive* part to the rule's
:meth:`~fedadapt.strategies.core.ServerRule.update` and averages the rest.
:meth:`ServerRule.step <fedadapt.strategies.core.ServerRule.step>` is the two
in a row. Plain NumPy: no Flower, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedadapt._validation import check_choice
from fedadapt.strategies.core import robust
from fedadapt.strategies.core.robust import Defence, RobustOptions

Arrays = dict[str, NDArray[Any]]


class Rule(Protocol):
    """What the round statistics need of a rule (:class:`.base.ServerRule`).

    A protocol rather than an import, so that base (which calls these
    functions in ``ServerRule.step``) and this module import each other in
    one direction only.
    """

    weighting: str
    needs_sq_norms: bool
    num_updates: int

    def adaptive_keys(self, current: Mapping[str, NDArray[Any]]) -> list[str]:
        """Return the keys the rule updates."""
        ...

    def scratch(self, like: NDArray[Any], slot: int = 0) -> NDArray[Any]:
        """Return a work array shaped like ``like`` (contents undefined)."""
        ...

    def update(
        self, current: Arrays, stats: RoundStatistics
    ) -> tuple[Arrays, dict[str, float]]:
        """Return the new adaptive arrays and diagnostics."""
        ...


#: How Δ̄ (and A) are formed from the updates: the weighted mean (the papers),
#: or Flower's robust aggregators applied to the updates (see
#: :func:`round_statistics`), or those of :mod:`.robust` (Krum, multi-Krum,
#: Bulyan, centered clipping).
AGGREGATIONS = ("mean", "median", "trimmed_mean", *robust.AGGREGATIONS)

#: What norm bounding does above its bound (:func:`clip_scales`): clip to
#: the bound, or flag and scale to the median norm of the others.
NORM_BOUND_MODES = ("clip", "flag")


def sq_norm(arrays: Mapping[str, NDArray[Any]]) -> float:
    """Return Σ_k ‖a_k‖² over the arrays, accumulated in float64."""
    return math.fsum(float(np.vdot(a, a)) for a in arrays.values())


@dataclass(frozen=True)
class RoundStatistics:
    """What a rule needs from one round (all a secure aggregator must reveal).

    Attributes
    ----------
    mean_update : Arrays
        Δ̄_t = Σ ω_i Δ_i over every array (adaptive and plain).
    mean_sq_norm : float | None
        A_t = Σ ω_i ‖Δ_i‖² over the adaptive arrays, or None when not needed.
    num_clients : int
        |S_t|, the number of replies aggregated.
    client_sq_norms : tuple[float, ...] | None
        Each client's ‖Δ_i‖² over the adaptive arrays (before any clipping)
        as the server computed it from the arrays; None when it did not
        (norms trusted from clients, or not needed).
    norm_bound : float | None
        The bound above which a ‖Δ_i‖ was clipped (see
        :func:`round_statistics`); None when clipping was off.
    clip_scales : tuple[float, ...] | None
        The factor each client's adaptive update was multiplied by (1 when
        not clipped); None when clipping was off.
    pull_scales : tuple[float, ...] | None
        The pull cap's part of ``clip_scales`` (:func:`contribution_scales`:
        the factor on top of the norm bound's; 1 where it did not act), so
        that a record can say which of the two clipped a reply; None when
        the pull cap was off.
    without_each : Callable[[], Iterator[tuple[Arrays, float | None]]] | None
        The step guard's leave-one-out statistics (:func:`leave_one_out`):
        called, it yields (Δ̄_{−i}, A_{−i}) client by client; None when the
        guard is off or cannot apply (fewer than 3 replies, a robust
        aggregation other than centered clipping, trusted norms).
    defence : Defence | None
        What an aggregator of :mod:`.robust` did (which updates it kept,
        centered clipping's factors); None for the others.
    consensus_cos : tuple[float, ...] | None
        Each client's cos(s_iΔ_i, μ_{−i}) with the weighted mean of the
        other clients' (clipped) updates, before the opposing projection
        (:func:`opposing_projection`); a negative value is a projected
        update. None when the projection is off.
    num_nodes : int | None
        N, the nodes the round's clients were sampled from: the federation's
        client count as the server knows it (FedDyn's m, SCAFFOLD's N); the
        adapters set it each round, a local update's
        :meth:`~fedadapt.strategies.local_update.LocalUpdate.configure` gets
        the same number. None where unknown (``ServerRule.step`` without it).
    unguarded_sq_norm : float | None
        The plain weighted mean A where the step guard replaced
        ``mean_sq_norm`` by its own (:func:`guarded_sq_norms`); None when
        the guard did not apply.
    a_left_out : int | None
        The index of the client whose ‖Δ_i‖² the guard's A left out; None
        when A is the plain mean.
    trimmed_shares : tuple[float, ...] | None
        The trimmed mean: per client, the share of its coordinates the
        trimmed mean cut (:func:`trimmed_counts`); None for the other
        aggregators.
    """

    mean_update: Arrays
    mean_sq_norm: float | None
    num_clients: int
    client_sq_norms: tuple[float, ...] | None = None
    norm_bound: float | None = None
    clip_scales: tuple[float, ...] | None = None
    pull_scales: tuple[float, ...] | None = None
    without_each: Callable[[], Iterator[tuple[Arrays, float | None]]] | None = None
    defence: Defence | None = None
    num_nodes: int | None = None
    consensus_cos: tuple[float, ...] | None = None
    unguarded_sq_norm: float | None = None
    a_left_out: int | None = None
    trimmed_shares: tuple[float, ...] | None = None


def client_weights(
    num_examples: Sequence[float], weighting: str, max_weight_ratio: float = 0.0
) -> NDArray[Any]:
    """Return ω: uniform ``1/|S|`` or ``n_i / Σ n_j``.

    The papers average uniformly (Δ-SGD arXiv:2306.11201 Alg. 1 line 13,
    FedDuA Alg. 1 lines 9 and 12, Fed-LAMB arXiv:2110.00532 Alg. 1 line 15);
    ``n_i``-weighting is Flower's default and the FedExP code's.

    ``max_weight_ratio = c > 0`` caps each count at c times the round's
    median count before normalising (``n_i ← min(n_i, c·median_j n_j)``):
    ``num-examples`` is the client's own claim, and without a cap one
    client that claims 100× the others' data takes almost all the weight
    (our choice; issue #38's ``false-weight`` attack).
    """
    n = np.asarray(num_examples, dtype=np.float64)
    if n.size == 0:
        raise ValueError("no client results to aggregate")
    if weighting == "uniform":
        return np.full(n.size, 1.0 / n.size)
    if not np.all(np.isfinite(n)) or np.any(n <= 0):
        raise ValueError(f"num_examples must be finite and > 0, got {n.tolist()}")
    if max_weight_ratio > 0:
        n = np.minimum(n, max_weight_ratio * float(np.median(n)))
    return n / n.sum()


def _acc_dtype(x_t: NDArray[Any]) -> np.dtype[Any]:
    """Accumulator dtype: float32 stays float32, integers sum in floating point."""
    return np.result_type(x_t.dtype, np.float32)


#: Elements per block of :func:`_weighted_sum`: the block of Σ, of x_t and
#: the scratch stay in cache while every client's block is added (256 KiB
#: of float32 each).
SUM_BLOCK = 1 << 16


def _client_differences(
    x_t: NDArray[Any], columns: Sequence[NDArray[Any]]
) -> Iterator[tuple[slice, int, NDArray[Any]]]:
    """Yield (block, i, x_i − x_t over the block), block by block.

    Every client in turn per block, so x_t, a running result and the one
    scratch block stay in cache (memory traffic: one read of each client
    array). The difference lives in that scratch block, overwritten by the
    next yield.
    """
    flat_x = np.ascontiguousarray(x_t).reshape(-1)
    flat_cols = [np.ascontiguousarray(c).reshape(-1) for c in columns]
    size = flat_x.size
    scratch = np.empty(min(size, SUM_BLOCK), dtype=_acc_dtype(x_t))
    for lo in range(0, size, SUM_BLOCK):
        hi = min(lo + SUM_BLOCK, size)
        block, x_block, delta = slice(lo, hi), flat_x[lo:hi], scratch[: hi - lo]
        for i, column in enumerate(flat_cols):
            np.subtract(column[lo:hi], x_block, out=delta)
            yield block, i, delta


def _weighted_sum(
    x_t: NDArray[Any],
    columns: Sequence[NDArray[Any]],
    weights: list[float],
    norms: NDArray[Any] | None,
) -> NDArray[Any]:
    """Return Σ_i ω_i (x_i − x_t) over one key; add ‖x_i − x_t‖² to ``norms[i]``.

    ``columns[i]`` is client i's array for the key. Weighted *differences*
    (better accuracy than Σω_i x_i − x_t when updates are small relative to
    the weights) are formed block by block (:func:`_client_differences`).
    Per element the arithmetic is the same in the same order as a
    whole-array loop; each ‖Δ_i‖² is summed from per-block float32 dot
    products in float64. Python-float weights keep float32 arrays float32
    (NumPy 2 would promote them with np.float64).
    """
    if len(weights) != len(columns):
        raise ValueError(f"{len(weights)} weights for {len(columns)} clients")
    acc = np.zeros(x_t.shape, dtype=_acc_dtype(x_t))
    flat_acc = acc.reshape(-1)
    for block, i, delta in _client_differences(x_t, columns):
        if norms is not None:
            norms[i] += float(np.vdot(delta, delta))
        delta *= weights[i]
        flat_acc[block] += delta
    return acc


def norm_bound(
    sq_norms: Sequence[float] | NDArray[Any] | None,
    max_norm: float,
    max_norm_ratio: float,
) -> float | None:
    """Return the clipping bound of a round, or None when clipping is off.

    The smaller of the absolute bound ``max_norm = C`` (when > 0) and
    ``max_norm_ratio = k`` times the median client update norm
    median_i ‖Δ_i‖ of the round (when > 0; the norm bounding of Sun et al.
    2019, "Can you really backdoor federated learning?", with a bound
    relative to the round instead of a tuned constant). An update above it
    is clipped (:func:`clip_scales` says to what). The median is
    unweighted over the round's replies, so a minority of clients moves it
    by at most one rank whatever the weight they claim. One reply is its own
    median (no clipping for k ≥ 1); with two replies the median is their
    mean, so neither can be singled out. A median of 0 (most updates are
    zero) gives the bound 0: every non-zero update is clipped to zero (our
    choice: a round whose typical client did not move gives the outlier no
    scale to move the model by).
    """
    bounds = [max_norm] if max_norm > 0 else []
    median = median_norm(sq_norms) if max_norm_ratio > 0 else None
    if median is not None:
        bounds.append(max_norm_ratio * median)
    return min(bounds) if bounds else None


def median_norm(sq_norms: Sequence[float] | NDArray[Any] | None) -> float | None:
    """Return median_i ‖Δ_i‖ (unweighted), or None without norms."""
    if sq_norms is None or not len(sq_norms):
        return None
    return float(np.median(np.sqrt(np.asarray(sq_norms, dtype=np.float64))))


def clip_scales(
    sq_norms: Sequence[float] | NDArray[Any],
    max_norm: float,
    max_norm_ratio: float,
    clip_mode: str = "flag",
) -> NDArray[Any]:
    """Return the factor s_i ≤ 1 each client's update is multiplied by.

    ``clip_mode="clip"`` (the strategies' default since issue #38): an
    update above k·m is clipped to k·m, s_i = min(1, k·m/‖Δ_i‖), so a
    client weighs at most k typical ones whatever norm it sends; the
    ``"flag"`` rule below left a client just under k = 5 weighing 5.

    ``max_norm = C > 0`` clips to C: s_i = min(1, C/‖Δ_i‖) (the flat clipping
    of DP-FedAvg, McMahan et al., arXiv 1710.06963). ``max_norm_ratio = k >
    0`` flags an update with ‖Δ_i‖ > k·m, m = median_j ‖Δ_j‖ of the round,
    and scales it down to the median norm of the updates not flagged (k·m
    when every update is, possible only for k < 1): a flagged update then
    weighs like one typical client in Δ̄ and A, not like k of them. Our
    choice: Sun et al. 2019 clip to a fixed M; clipping to k·m with the
    k ≥ 3 that honest spreads need left a ×1e6 client at 22–34 % off the
    honest loss on digits-mlp, and the median of the unflagged norms, which
    the flagged ones do not shift, came closer to the honest run than m on
    mnist5k-cnn (docs/failures.md). Updates at or below k·m are untouched
    (s_i = 1 exactly). With both bounds the smaller factor applies.
    """
    norms = np.sqrt(np.asarray(sq_norms, dtype=np.float64))
    scales = np.ones_like(norms)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN: dropped later
        if max_norm > 0:
            scales = np.where(norms > max_norm, max_norm / norms, scales)
        median = median_norm(sq_norms) if max_norm_ratio > 0 else None
        if median is not None:
            threshold = max_norm_ratio * median
            flagged = norms > threshold
            if clip_mode == "clip":  # to the bound itself
                return np.where(flagged, np.minimum(scales, threshold / norms), scales)
            kept = norms[~flagged]
            target = float(np.median(kept)) if kept.size else threshold
            scales = np.where(flagged, np.minimum(scales, target / norms), scales)
    return scales


#: Relative tolerance of the pull cap: pulls within it of the bound are not cut.
PULL_RTOL = 1e-9


def contribution_scales(
    weights: Sequence[float] | NDArray[Any],
    sq_norms: Sequence[float] | NDArray[Any],
    scales: NDArray[Any] | None,
    max_contribution_ratio: float,
) -> NDArray[Any]:
    """Return clip factors that also bound each client's pull ω_i·s_i·‖Δ_i‖.

    A client's pull on Δ̄ is its weight times the norm of its (clipped)
    update. The norm bound (:func:`clip_scales`) and the weight cap
    (:func:`client_weights`) each allow 2× a typical client, so together a
    client could pull like 4: one that claims the largest count the cap
    allows and sends its update at the norm bound (issue #38's
    ``false-weight``) cost FedAvg 27 and FedAdam 11 accuracy points on
    digits-mlp. With k = ``max_contribution_ratio`` > 0 each factor becomes
    s_i·min(1, k·p̃ / p_i), p_i = ω_i s_i ‖Δ_i‖ and p̃ the round's median
    pull (unweighted over the replies, as the norm bound's median). Under
    uniform weighting this is the norm bound again (a no-op for k at least
    the norm bound's ratio). A median pull of 0 clips every non-zero pull
    to zero, as :func:`norm_bound` does. Our choice (issue #38; measured in
    docs/robustness.md).
    """
    norms = np.sqrt(np.asarray(sq_norms, dtype=np.float64))
    base = np.ones_like(norms) if scales is None else np.asarray(scales, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN: dropped later
        pulls = np.asarray(weights, dtype=np.float64) * base * norms
        bound = max_contribution_ratio * float(np.median(pulls))
        # a pull at the bound up to rounding (an update the norm bound clipped
        # to the median's multiple, at a median weight) is not above it
        factors = np.where(pulls > bound * (1 + PULL_RTOL), bound / pulls, 1.0)
    return base * factors


def _dots_with(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    direction: Mapping[str, NDArray[Any]],
    keys: Sequence[str],
) -> NDArray[Any]:
    """Return ⟨x_i − x_t, d⟩ per client over ``keys`` (float64 totals).

    Block by block (:func:`_client_differences`), so no client's difference
    is held whole.
    """
    dots = np.zeros(len(clients))
    for k in keys:
        flat_d = np.ascontiguousarray(direction[k]).reshape(-1)
        for block, i, delta in _client_differences(current[k], [c[k] for c in clients]):
            dots[i] += float(np.vdot(delta, flat_d[block]))
    return dots


@dataclass(frozen=True)
class Projection:
    """What :func:`opposing_projection` did to one round."""

    #: Σ ω_i e'_i over the projected keys (the new Δ̄'s adaptive part)
    mean_update: Arrays
    #: cos(e_i, μ_{−i}) per client, before projection
    cosines: tuple[float, ...]
    #: ‖e'_i‖² per client (after projection)
    sq_norms: tuple[float, ...]
    #: β_i per client (0 where not projected): e'_i = e_i − β_i (Δ̄ − ω_i e_i)
    betas: tuple[float, ...]


def opposing_projection(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    weights: Sequence[float],
    scales: NDArray[Any] | None,
    sq_norms: NDArray[Any],
    mean_update: Mapping[str, NDArray[Any]],
    keys: Sequence[str],
) -> Projection:
    """Remove from each update the part that points against the others' mean.

    With e_i = s_iΔ_i (the clipped update), Δ̄ = Σ_j ω_j e_j and the
    weighted mean of the others μ_{−i} = (Δ̄ − ω_i e_i)/(1 − ω_i): where
    ⟨e_i, μ_{−i}⟩ < 0, e_i is replaced by its projection on the plane
    orthogonal to μ_{−i},

        e'_i = e_i − β_i u_i,  u_i = Δ̄ − ω_i e_i,  β_i = ⟨e_i, u_i⟩ / ‖u_i‖²,

    every client against the same round (simultaneously, not in turn). No
    client can then pull Δ̄ back along what the others agree on: a sign
    flip or inner-product manipulation (Xie et al. 2019) keeps only its
    part orthogonal to the others' mean. An honest update is touched only
    where it already opposes the others, and loses only that component
    (cos² of its energy). Our choice (issue #38): on digits-mlp it cut
    what one sign-flipping client of ten costs FedAvg from 12.4 to 5.4
    accuracy points and IPM from 11.6 to 1.4, honest runs within 0.3
    points (docs/robustness.md). Opt-in all the same: where clients hold
    one class each, honest updates oppose one another and it moved the
    smoke suites' honest runs by up to 6.6 points. The others' mean is the
    reference, not a robust estimate of it: colluders shift each other's
    reference. Only ``keys`` (the rule's adaptive arrays, as the norm
    bound) are projected.

    Costs one more pass over the clients' ``keys`` (the inner products
    ⟨Δ_i, Δ̄⟩) and one over the projected ones; the rest is closed form
    from ‖Δ_i‖² = ``sq_norms`` and ‖Δ̄‖². Returns the new Σ ω_i e'_i over
    ``keys``, each cos(e_i, μ_{−i}), each ‖e'_i‖² and β_i.
    """
    w = np.asarray(weights, dtype=np.float64)
    s = np.ones(len(clients)) if scales is None else np.asarray(scales, np.float64)
    n = np.asarray(sq_norms, dtype=np.float64)
    g = _dots_with(current, clients, mean_update, keys)  # ⟨Δ_i, Δ̄⟩
    total = sum(float(np.vdot(mean_update[k], mean_update[k])) for k in keys)
    own_sq = s * s * n  # ‖e_i‖²
    along = s * g - w * own_sq  # ⟨e_i, u_i⟩
    u_sq = np.maximum(total - 2 * w * s * g + w * w * own_sq, 0.0)  # ‖u_i‖²
    with np.errstate(divide="ignore", invalid="ignore"):
        cosines = np.where(own_sq * u_sq > 0, along / np.sqrt(own_sq * u_sq), 0.0)
        opposed = (along < 0) & (u_sq > 0) & (w < 1)
        betas = np.where(opposed, along / u_sq, 0.0)
        new_sq = np.where(opposed, np.maximum(own_sq - along * betas, 0.0), own_sq)
    projected = {k: np.array(mean_update[k]) for k in keys}
    if np.any(opposed):
        keep = 1.0 - float(np.dot(w, betas))
        for k in keys:
            acc = projected[k]
            acc *= keep
            for i in np.flatnonzero(opposed).tolist():
                delta = np.subtract(clients[i][k], current[k], dtype=acc.dtype)
                delta *= w[i] * w[i] * betas[i] * s[i]
                acc += delta
    return Projection(
        projected,
        tuple(cosines.tolist()),
        tuple(new_sq.tolist()),
        tuple(betas.tolist()),
    )


def robust_mean(stack: NDArray[Any], aggregation: str, trim_fraction: float) -> Any:
    """Reduce per-client values (axis 0) by ``aggregation``.

    ``"median"``: the coordinate-wise median (Yin et al. 2018; Flower's
    ``FedMedian``, ``np.median``). ``"trimmed_mean"``: drop the
    ``int(trim_fraction·n)`` smallest and largest values per coordinate and
    average the rest (Yin et al. 2018; Flower's ``FedTrimmedAvg`` with
    ``beta = trim_fraction``, SciPy's ``trim_mean``). Both are unweighted,
    as Flower's.
    """
    if aggregation == "median":
        return np.median(stack, axis=0)
    n = stack.shape[0]
    cut = trim_count(n, trim_fraction)
    if cut == 1 and stack.dtype.kind == "f":
        # one value at each end (FedAvgM's default, 0.1 of ten): the sum less
        # the smallest and the largest, three passes instead of a partition
        # along the short axis (10x faster on 10 x 2 M values); float64 sums
        rest = np.sum(stack, axis=0, dtype=np.float64)
        rest -= np.min(stack, axis=0)
        rest -= np.max(stack, axis=0)
        return (rest / (n - 2)).astype(stack.dtype)
    kept = np.partition(stack, (cut, n - cut - 1), axis=0)[cut : n - cut]
    return np.mean(kept, axis=0)


def trim_count(num_clients: int, trim_fraction: float) -> int:
    """Return the values the trimmed mean cuts at each end of a coordinate."""
    return int(trim_fraction * num_clients)


def trimmed_counts(stack: NDArray[Any], cut: int) -> NDArray[np.int64]:
    """Per client (axis 0), the coordinates where the trimmed mean cut it.

    A client's value counts where it lies strictly below the smallest kept
    value or strictly above the largest (the ``cut``-th order statistics
    from either end): a value tied with a kept one was not set aside for
    being extreme, so ties (every client 0 on a constant input pixel) count
    for nobody. Honest clients are cut at about 2·cut/n of their
    coordinates; a client far from the others at many more. Not weighted,
    as the trimmed mean is not.
    """
    n = stack.shape[0]
    if cut == 0 or n <= 2 * cut:
        return np.zeros(n, dtype=np.int64)
    if cut == 1:  # the smallest and largest: no partition (see robust_mean)
        low, high = np.min(stack, axis=0), np.max(stack, axis=0)
        at_low, at_high = stack == low, stack == high
        outside = at_low & (np.sum(at_low, axis=0) == 1)
        outside |= at_high & (np.sum(at_high, axis=0) == 1)
    else:
        ordered = np.partition(stack, (cut, n - cut - 1), axis=0)
        outside = (stack < ordered[cut]) | (stack > ordered[n - cut - 1])
    return outside.reshape(n, -1).sum(axis=1, dtype=np.int64)


#: Fewest replies for the step guard: leaving one of two out leaves a
#: single client, whose own step says nothing about the others'.
GUARD_MIN_CLIENTS = 3

#: Fewest replies for the guard's A (:func:`guarded_sq_norms`): each
#: leave-one-out A then still averages two clients after its trim.
GUARD_A_MIN_CLIENTS = 4

#: Pairs (i, j) formed at once by :func:`guarded_sq_norms` (~8 MB each).
_PAIR_BLOCK = 1 << 20


def leave_one_out(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    effective_weights: Sequence[float],
    weights: Sequence[float],
    stats_mean: Mapping[str, NDArray[Any]],
    sq_norms_without: Sequence[float] | None,
    keys: Sequence[str],
    shifts: Sequence[float] | None = None,
    shift_base: Mapping[str, NDArray[Any]] | None = None,
) -> Callable[[], Iterator[tuple[Arrays, float | None]]]:
    """Return a generator of each client's leave-one-out round statistics.

    With Δ̄ = Σ_j ω_j s_j Δ_j (s_j: clip factor), leaving client i out and
    renormalising the weights gives

        Δ̄_{−i} = (Δ̄ − ω_i s_i Δ_i) / (1 − ω_i),

    yielded with ``sq_norms_without[i]``, the A of the round without client
    i (:func:`guarded_sq_norms`; None when the rule needs no A).

    One client's pair at a time (one model-sized buffer, not n of them),
    over ``keys`` only (the rule's adaptive arrays). What the step guard of
    the adaptive rules needs (:meth:`ServerRule.guarded_step`): the server
    step each client's absence would give. ``shifts`` c_i and
    ``shift_base`` B: client i's part of Δ̄ is ``effective_weights[i]``·Δ_i
    + c_i·B (a projected update, :func:`opposing_projection`: B is the
    Δ̄ before projection).
    """

    def generate() -> Iterator[tuple[Arrays, float | None]]:
        for i, client in enumerate(clients):
            rest = 1.0 - weights[i]
            if rest <= 0:
                continue
            delta = {}
            for k in keys:
                own = np.subtract(client[k], current[k], dtype=_acc_dtype(current[k]))
                own *= effective_weights[i]
                if shifts is not None and shift_base is not None and shifts[i]:
                    own += shifts[i] * shift_base[k]
                delta[k] = (stats_mean[k] - own) / rest
            a = None if sq_norms_without is None else sq_norms_without[i]
            yield delta, a

    return generate


def guarded_sq_norms(
    weights: NDArray[Any], per_client: NDArray[Any], mean_sq_norm: float
) -> tuple[float, list[float], int | None]:
    """Return the step guard's A, each client's leave-one-out A, who is left out.

    FedExP's and FedDuA's step grows with A = Σ ω_j‖Δ_j‖² (FedExP Alg. 1;
    DUA Alg. 1 line 12), so a client can also *lower* the server's step:
    by sending a short update. "A little is enough" with one client of ten
    sends the honest mean μ, which leaves Δ̄ where it was and adds
    ‖μ‖² (a fraction of a client's own ‖Δ_i‖²) to A; FedExPM's step then
    ran 7.5–8.3 % below the step with that client absent, every round
    (docs/robustness.md). The leave-one-out cap of the step guard acts from
    above only and all but one of its leave-one-out rounds hold the short
    update. So, with the guard (our addition, not in the papers), A is the
    largest leave-one-out A,

        A' = max_j A_{−j},   A_{−j} = (A − ω_j‖Δ_j‖²)/(1 − ω_j),

    the round's A without the client whose absence raises it most (under
    uniform weights, the shortest update; max_j A_{−j} ≥ A always, since A
    is a weighted mean of them). Whatever client k sends, A' ≥ A_{−k}, the
    other clients' own A: no single client can lower it (what it can still
    do is keep the shortest honest update in, where its absence would have
    left that one out). Client i's leave-one-out A (what the
    guard's min_i η^{(−i)} uses) is the same statistic over the others,
    max_{j≠i} A_{−i,−j} with A_{−i,−j} = (A − ω_i‖Δ_i‖² − ω_j‖Δ_j‖²) /
    (1 − ω_i − ω_j), falling back to the plain A_{−i} where no pair leaves
    weight. With fewer than :data:`GUARD_A_MIN_CLIENTS` replies A is left
    as it is and the leave-one-out A's are the plain A_{−i}. The third value
    is the index j of the client left out of A' (None when A is left as
    it is): what its record in clients.jsonl calls ``a_left_out``.

    Its honest cost is a slightly longer step: on digits-mlp (5 seeds) the
    honest runs of FedExP, FedExPM and both FedDuA variants ended 0.1–1.1
    points *higher* (docs/robustness.md).
    """
    weights = np.asarray(weights, dtype=np.float64)
    sq = np.asarray(per_client, dtype=np.float64)
    weighted = weights * sq
    rest = 1.0 - weights
    with np.errstate(divide="ignore", invalid="ignore"):
        without = np.where(rest > 0, (mean_sq_norm - weighted) / rest, 0.0)
    without = np.maximum(without, 0.0)
    n = len(sq)
    if n < GUARD_A_MIN_CLIENTS:
        return mean_sq_norm, without.tolist(), None
    if np.all(weights == weights[0]):  # uniform (the papers'): the shortest other
        order = np.argsort(sq, kind="stable")
        other = np.where(np.arange(n) == order[0], sq[order[1]], sq[order[0]])
        pair_rest = 1.0 - 2.0 * weights[0]
        guarded_without = np.maximum(
            (mean_sq_norm - weighted - weights[0] * other) / pair_rest, 0.0
        )
        left_out = int(order[0])
    else:
        guarded_without, left_out = _pairwise_sq_norms(
            weights, weighted, mean_sq_norm, without
        )
    return (
        float(max(mean_sq_norm, without[left_out])),
        guarded_without.tolist(),
        left_out,
    )


def _pairwise_sq_norms(
    weights: NDArray[Any],
    weighted: NDArray[Any],
    mean_sq_norm: float,
    without: NDArray[Any],
) -> tuple[NDArray[Any], int]:
    """max_{j≠i} A_{−i,−j} for unequal weights (:func:`guarded_sq_norms`)."""
    n = len(weights)
    best = np.empty(n)
    rows = max(1, _PAIR_BLOCK // n)  # pairs in blocks: n² floats for 10⁴ replies
    for start in range(0, n, rows):
        block = slice(start, min(n, start + rows))
        pair_rest = 1.0 - weights[block, None] - weights[None, :]
        valid = pair_rest > 0
        own = np.arange(block.start, block.stop)
        valid[own - start, own] = False
        with np.errstate(divide="ignore", invalid="ignore"):
            left = mean_sq_norm - weighted[block, None] - weighted[None, :]
            pairs = left / pair_rest
        best[block] = np.where(valid, np.maximum(pairs, 0.0), -np.inf).max(axis=1)
    return np.where(np.isfinite(best), best, without), int(np.argmax(without))


def round_statistics(
    rule: Rule,
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    num_examples: Sequence[float],
    sq_norms: Sequence[float] | None = None,
    *,
    max_norm: float = 0.0,
    max_norm_ratio: float = 0.0,
    aggregation: str = "mean",
    trim_fraction: float = 0.2,
    clip_mode: str = "flag",
    max_weight_ratio: float = 0.0,
    step_guard: bool = False,
    robust_options: RobustOptions | None = None,
    center: Mapping[str, NDArray[Any]] | None = None,
    max_contribution_ratio: float = 0.0,
    project_opposing: bool = False,
    own_norms: bool = False,
) -> RoundStatistics:
    """Form Δ̄ and (when ``rule`` needs it) A from per-client arrays.

    ``sq_norms`` are client-reported ‖Δ_i‖², used as given (what secure
    aggregation requires: the server trusts them). Without them the
    server computes each ‖Δ_i‖² over the adaptive arrays in the same loop
    that sums Δ_i (no second pass) and returns them in
    ``client_sq_norms`` (also when no defence needs them, with
    ``own_norms``: the norm ceiling's anchor).

    Clipping: each client's adaptive update becomes ``s_i·Δ_i`` before
    it enters Δ̄ and A (A then uses the clipped norms s_i²‖Δ_i‖²); plain
    arrays are aggregated unclipped. ``max_norm = C > 0`` clips to C;
    ``max_norm_ratio = k > 0`` scales an update above k times the round's
    median ‖Δ_i‖ down to the median norm of the other updates
    (:func:`clip_scales`); the bound b
    above which updates are clipped is recorded (:func:`norm_bound`).
    The relative bound is known only once every norm is, so the sum is
    formed unclipped first and formed again with the clip factors in the
    weights only when some update exceeds b: a round without an outlier
    costs one pass and gives exactly the unclipped Δ̄ and A. Clipping
    needs the server's own norms, so it excludes ``sq_norms``.

    ``aggregation``: ``"mean"`` is Σω_iΔ_i. ``"median"`` /
    ``"trimmed_mean"`` replace it by the coordinate-wise median /
    ``trim_fraction``-trimmed mean of the (clipped) updates, every array
    included (:func:`robust_mean`, unweighted as Flower's FedMedian /
    FedTrimmedAvg), and A by the same statistic of the (clipped)
    ‖Δ_i‖² (our choice: a mean A would let one outlier's norm inflate
    FedExP/FedDuA's step size again). They need the individual updates,
    so they exclude ``sq_norms`` too. ``"krum"``, ``"multi_krum"``,
    ``"bulyan"`` and ``"centered_clipping"`` (with ``robust_options``, and
    ``center``, centered clipping's v_0: the previous round's Δ̄, None =
    zero) form Δ̄ and A from the (clipped) updates as
    :func:`.robust.robust_statistics` says; what they did is ``defence``.

    With the mean and the server's own norms: ``max_contribution_ratio``
    k > 0 also bounds each client's pull ω_i·s_i·‖Δ_i‖ to k times the
    round's median (:func:`contribution_scales`), and ``project_opposing``
    removes from each update its part against the others' mean
    (:func:`opposing_projection`; Δ̄, A and the step guard's leave-one-out
    statistics then use the projected updates). Both are inactive with
    ``sq_norms`` and with a robust ``aggregation``. So is the step guard,
    but for centered clipping, whose last iteration is a mean of clipped
    updates that the guard leaves one client out of (:func:`_clipping_guard`).
    """
    if max_norm < 0 or not math.isfinite(max_norm):
        raise ValueError(f"max_norm must be finite and >= 0, got {max_norm}")
    if max_norm_ratio < 0 or not math.isfinite(max_norm_ratio):
        raise ValueError(
            f"max_norm_ratio must be finite and >= 0, got {max_norm_ratio}"
        )
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_choice("clip_mode", clip_mode, NORM_BOUND_MODES)
    if max_weight_ratio < 0 or not math.isfinite(max_weight_ratio):
        raise ValueError(
            f"max_weight_ratio must be finite and >= 0, got {max_weight_ratio}"
        )
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    if max_contribution_ratio < 0 or not math.isfinite(max_contribution_ratio):
        raise ValueError(
            "max_contribution_ratio must be finite and >= 0, "
            f"got {max_contribution_ratio}"
        )
    own_mean = aggregation == "mean" and sq_norms is None
    limit_pull = own_mean and max_contribution_ratio > 0
    project = own_mean and project_opposing and len(clients) >= 2
    clip = max_norm > 0 or max_norm_ratio > 0
    if (clip or aggregation != "mean") and sq_norms is not None:
        raise ValueError(
            "clipping and robust aggregation need the server's own norms, not sq_norms"
        )
    weights = client_weights(num_examples, rule.weighting, max_weight_ratio).tolist()
    adaptive = rule.adaptive_keys(current)
    compute = sq_norms is None and (
        rule.needs_sq_norms or clip or limit_pull or project or own_norms
    )
    norms = np.zeros(len(clients)) if compute else None
    one_pass = max_norm > 0 and max_norm_ratio == 0 and not limit_pull
    if one_pass and aggregation == "mean":
        # the bound is known in advance: clip in the one pass
        assert norms is not None, "clipping computes the clients' norms"
        mean_update = _clipped_sum(current, clients, weights, adaptive, norms, max_norm)
    else:
        # a robust aggregate is formed below: here only the norms it needs
        keys = list(current) if aggregation == "mean" else (adaptive if compute else [])
        keyed = set(adaptive) if compute else set()
        mean_update = {
            k: _weighted_sum(
                current[k],
                [c[k] for c in clients],
                weights,
                norms if k in keyed else None,
            )
            for k in keys
        }
    bound, scales = None, None
    if clip:
        assert norms is not None, "clipping computes the clients' norms"
        bound = norm_bound(norms, max_norm, max_norm_ratio)
        scales = clip_scales(norms, max_norm, max_norm_ratio, clip_mode)
    pull_factors = None
    if limit_pull:
        assert norms is not None, "the pull bound computes the clients' norms"
        before_pull = np.ones(len(clients)) if scales is None else scales
        scales = contribution_scales(weights, norms, scales, max_contribution_ratio)
        with np.errstate(divide="ignore", invalid="ignore"):
            pull_factors = np.where(before_pull > 0, scales / before_pull, 1.0)
    defence, robust_a, trimmed_shares = None, None, None
    if aggregation in robust.AGGREGATIONS:
        mean_update, robust_a, defence = robust.robust_statistics(
            current,
            clients,
            weights,
            adaptive,
            scales,
            aggregation,
            robust_options or RobustOptions(),
            center,
            need_sq_norm=rule.needs_sq_norms,
        )
    elif aggregation != "mean":
        mean_update, trimmed_shares = _robust_update(
            current, clients, adaptive, scales, aggregation, trim_fraction
        )
    elif scales is not None and np.any(scales < 1) and not one_pass:
        clipped = (np.asarray(weights) * scales).tolist()
        for k in adaptive:
            mean_update[k] = _weighted_sum(
                current[k], [c[k] for c in clients], clipped, None
            )
    projection = None
    if project:
        assert norms is not None, "the projection computes the clients' norms"
        projection = opposing_projection(
            current, clients, weights, scales, norms, mean_update, adaptive
        )
        before_projection = {k: mean_update[k] for k in adaptive}
        mean_update.update(projection.mean_update)
    mean_sq_norm = untrimmed_sq_norm = a_left_out = None
    per_client = None
    if rule.needs_sq_norms:
        per_client = norms if norms is not None else np.asarray(sq_norms, float)
        if scales is not None:
            per_client = per_client * scales**2
        if projection is not None:
            per_client = np.asarray(projection.sq_norms)
        if defence is not None:
            mean_sq_norm = robust_a
        elif aggregation == "mean":
            mean_sq_norm = float(np.dot(weights, per_client))
        else:
            mean_sq_norm = float(
                robust_mean(np.asarray(per_client), aggregation, trim_fraction)
            )
    without_each = None
    clipped_around = (
        defence is not None
        and defence.center_scales is not None
        and defence.center_origin is not None
    )
    if step_guard and clipped_around and len(clients) >= GUARD_MIN_CLIENTS:
        assert defence is not None and defence.center_origin is not None
        mean_sq_norm, without_each, a_left_out, untrimmed_sq_norm = _clipping_guard(
            current, clients, scales, defence, mean_update, mean_sq_norm, adaptive
        )
    guarded = step_guard and aggregation == "mean" and sq_norms is None
    if guarded and len(clients) >= GUARD_MIN_CLIENTS:
        sq_without = None
        if mean_sq_norm is not None and per_client is not None:
            plain_sq_norm = mean_sq_norm
            mean_sq_norm, sq_without, a_left_out = guarded_sq_norms(
                np.asarray(weights), np.asarray(per_client), mean_sq_norm
            )
            if a_left_out is not None:  # the guard's A replaced the plain one
                untrimmed_sq_norm = plain_sq_norm
        effective = np.asarray(weights) * (1.0 if scales is None else scales)
        shifts = None
        if projection is not None:  # ω_i e'_i = ω_i s_i (1 + ω_i β_i) Δ_i − ω_i β_i Δ̄
            betas = np.asarray(projection.betas)
            effective = effective * (1 + np.asarray(weights) * betas)
            shifts = (-np.asarray(weights) * betas).tolist()
        without_each = leave_one_out(
            current,
            clients,
            list(map(float, effective)),
            weights,
            mean_update,
            sq_without,
            adaptive,
            shifts,
            before_projection if projection is not None else None,
        )
    return RoundStatistics(
        mean_update,
        mean_sq_norm,
        len(clients),
        None if norms is None else tuple(norms.tolist()),
        bound,
        None if scales is None else tuple(scales.tolist()),
        None if pull_factors is None else tuple(pull_factors.tolist()),
        without_each,
        defence,
        consensus_cos=None if projection is None else projection.cosines,
        unguarded_sq_norm=untrimmed_sq_norm,
        a_left_out=a_left_out,
        trimmed_shares=trimmed_shares,
    )


def _clipping_guard(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    scales: NDArray[Any] | None,
    defence: Defence,
    mean_update: Mapping[str, NDArray[Any]],
    mean_sq_norm: float | None,
    adaptive: Sequence[str],
) -> tuple[
    float | None,
    Callable[[], Iterator[tuple[Arrays, float | None]]],
    int | None,
    float | None,
]:
    """Return the step guard's A, leave-one-out, A's left-out client, plain A.

    Centered clipping's last iteration is a plain mean of the effective
    updates e_i = v + c_i (s_i Δ_i − v) (v its centre, c_i its factor, s_i
    the norm bound's), Δ̄ = (1/n) Σ e_i and A = (1/n) Σ ‖e_i‖²
    (:class:`~fedadapt.strategies.core.robust.CenteredClipping`), so the
    guard of the mean applies to the e_i unchanged: client i's part of Δ̄ is
    (c_i s_i / n) Δ_i + ((1 − c_i)/n) v, and leaving it out gives the
    clipped mean of the others around the same centre and with the same τ
    (:func:`leave_one_out`); A is guarded as the mean's
    (:func:`guarded_sq_norms`, uniform weights). With more than one
    iteration it leaves the client out of the last one: v_{L−1} still holds
    its part of the earlier ones (exact for one iteration, the default).
    Our addition: without it
    a hostile reply clipped to τ could still shorten Δ̄ and so raise
    FedExP's step A/(2‖Δ̄‖²), which the guard exists to stop.
    """
    factors = np.asarray(defence.center_scales, dtype=np.float64)
    n = len(clients)
    uniform = np.full(n, 1.0 / n)
    bound = np.ones(n) if scales is None else np.asarray(scales, dtype=np.float64)
    sq_without, a_left_out, plain = None, None, None
    if mean_sq_norm is not None and defence.effective_sq_norms is not None:
        plain = mean_sq_norm
        mean_sq_norm, sq_without, a_left_out = guarded_sq_norms(
            uniform, np.asarray(defence.effective_sq_norms), mean_sq_norm
        )
    without_each = leave_one_out(
        current,
        clients,
        (factors * bound / n).tolist(),
        uniform.tolist(),
        mean_update,
        sq_without,
        list(adaptive),
        ((1.0 - factors) / n).tolist(),
        defence.center_origin,
    )
    return mean_sq_norm, without_each, a_left_out, None if a_left_out is None else plain


def _robust_update(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    adaptive: list[str],
    scales: NDArray[Any] | None,
    aggregation: str,
    trim_fraction: float,
) -> tuple[Arrays, tuple[float, ...] | None]:
    """Coordinate-wise ``aggregation`` of the updates, key by key.

    Adaptive keys are scaled by the clip factors first. One key's
    updates of every client are held at once (as Flower's FedMedian
    holds every client's model). Also returns, for the trimmed mean, each
    client's share of the coordinates it cut (:func:`trimmed_counts`, over
    every array), else None.
    """
    out: Arrays = {}
    n = len(clients)
    trimming = aggregation == "trimmed_mean"
    cut = trim_count(n, trim_fraction)
    counts = np.zeros(n, dtype=np.int64)
    size = 0
    for k, x_t in current.items():
        stack = np.stack(
            [np.subtract(c[k], x_t, dtype=_acc_dtype(x_t)) for c in clients]
        )
        if scales is not None and k in adaptive:
            factors = scales.astype(stack.dtype)
            stack *= factors.reshape((-1,) + (1,) * x_t.ndim)
        out[k] = np.asarray(
            robust_mean(stack, aggregation, trim_fraction), dtype=stack.dtype
        )
        if trimming:
            counts += trimmed_counts(stack, cut)
            size += x_t.size
    if not trimming:
        return out, None
    return out, tuple((counts / max(size, 1)).tolist())


def _clipped_sum(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    weights: list[float],
    adaptive: list[str],
    norms: NDArray[Any],
    max_norm: float,
) -> Arrays:
    """Σ ω_i·min(1, C/‖Δ_i‖)·Δ_i over the adaptive keys, Σ ω_i Δ_i elsewhere.

    Client by client: ‖Δ_i‖ is known only after all of a client's
    adaptive arrays, so their differences are held in one model-sized
    buffer (reused) while the norm is formed; a single pass still.
    """
    buffers = {k: np.empty(current[k].shape, _acc_dtype(current[k])) for k in adaptive}
    sums = {k: np.zeros_like(b) for k, b in buffers.items()}
    for i, (client, w) in enumerate(zip(clients, weights, strict=True)):
        for k, delta in buffers.items():
            np.subtract(client[k], current[k], out=delta)
            norms[i] += float(np.vdot(delta, delta))
        norm = math.sqrt(norms[i])
        scale = w * (max_norm / norm if norm > max_norm else 1.0)
        for k, delta in buffers.items():
            delta *= scale
            sums[k] += delta
    return {
        k: sums[k]
        if k in sums
        else _weighted_sum(x_t, [c[k] for c in clients], weights, None)
        for k, x_t in current.items()
    }


def apply_statistics(
    rule: Rule, current: Mapping[str, NDArray[Any]], stats: RoundStatistics
) -> tuple[Arrays, dict[str, float]]:
    """Apply ``rule`` to a round's statistics; return new arrays, diagnostics.

    Adaptive keys go through :meth:`ServerRule.update`; plain keys become
    ``x_t + Δ̄`` (the average), cast back to their dtype. ``stats`` may come
    from :func:`round_statistics` or from a secure aggregator's sums alone.
    Counts the update in ``rule.num_updates``.
    """
    if set(stats.mean_update) != set(current):
        raise ValueError("mean_update keys differ from the current arrays")
    keys = rule.adaptive_keys(current)
    new, diagnostics = rule.update(
        {k: current[k] for k in keys},
        RoundStatistics(
            {k: stats.mean_update[k] for k in keys},
            stats.mean_sq_norm,
            stats.num_clients,
            without_each=stats.without_each,
            num_nodes=stats.num_nodes,
        ),
    )
    for key, x_t in current.items():
        if key in new:
            new[key] = np.asarray(new[key], dtype=x_t.dtype)
            continue
        mean = x_t + stats.mean_update[key]
        if x_t.dtype.kind != "f":
            mean = np.rint(mean)
        new[key] = np.asarray(mean, dtype=x_t.dtype)
    rule.num_updates += 1
    diagnostics["mean-client-sq-norm"] = (
        stats.mean_sq_norm if stats.mean_sq_norm is not None else float("nan")
    )
    if stats.unguarded_sq_norm is not None:
        diagnostics["mean-client-sq-norm-unguarded"] = stats.unguarded_sq_norm
    diagnostics["mean-update-sq-norm"] = sq_norm(
        {k: stats.mean_update[k] for k in keys}
    )
    # how far the server moved the adaptive arrays: against A, how far an
    # adaptive step carried the clients' updates (FedAvg's ≤ A); in the
    # rule's scratch buffer and accumulated as sq_norm does (no temporaries)
    moves = (
        np.subtract(new[k], current[k], out=rule.scratch(current[k])) for k in keys
    )  # one key at a time: the buffer is shared
    diagnostics["server-move-sq-norm"] = math.fsum(
        float(np.vdot(move, move)) for move in moves
    )
    return new, diagnostics
