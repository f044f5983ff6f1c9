"""Robust aggregators over whole updates: Krum, multi-Krum, Bulyan, centered clipping.

Each turns a round's client updates Δ_i = x_i − x_t into the Δ̄ (and the A)
that any server rule then steps on, as the coordinate-wise median and
trimmed mean of :func:`~fedadapt.strategies.core.aggregation.robust_mean` do:

- **Krum / multi-Krum** (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS
  2017, "Machine Learning with Adversaries: Byzantine Tolerant Gradient
  Descent", §4): score(i) = Σ_{i→j} ‖Δ_i − Δ_j‖² over the n − f − 2 updates
  nearest to Δ_i; Krum keeps the update of the smallest score, multi-Krum
  averages the m updates of the smallest scores (:func:`krum_scores`,
  :func:`krum_select`). Needs n > 2f + 2.
- **Bulyan** (El Mhamdi, Guerraoui, Rouault, ICML 2018, "The Hidden
  Vulnerability of Distributed Learning in Byzantium", §4, Algorithm 1 with
  Krum as A): select θ = n − 2f updates by applying Krum to the remaining
  ones and removing the winner, θ times (:func:`bulyan_select`); then per
  coordinate average the β = θ − 2f selected values closest to their median
  (:func:`bulyan_coordinates`). Needs n ≥ 4f + 3.
- **Centered clipping** (Karimireddy, He, Jaggi, ICML 2021, "Learning from
  History for Byzantine Robust Optimization", §4, eq. CC): from a centre v
  (the previous round's aggregate), L times
  v ← v + (1/n) Σ_i clip_τ(Δ_i − v), clip_τ(x) = x·min(1, τ/‖x‖)
  (:func:`centered_clipping`).

Distances and norms run over every array of the update, flattened into one
vector, as Flower's ``Krum`` / ``MultiKrum`` / ``Bulyan`` do on the whole
model (``x_i − x_j = Δ_i − Δ_j``); they are accumulated in float64. Plain
NumPy: no Flower, no SciPy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

Arrays = dict[str, NDArray[Any]]

#: Aggregators that keep some updates whole and drop the others.
SELECTIONS = ("krum", "multi_krum", "bulyan")
#: Every aggregator of this module (the ``aggregation`` names).
AGGREGATIONS = (*SELECTIONS, "centered_clipping")

#: Default of ``num_hostile``: f, the hostile clients Krum and Bulyan assume.
DEFAULT_NUM_HOSTILE = 1


def _check_int(name: str, value: Any, low: int) -> int:
    """Return ``value`` as int, or raise ValueError naming ``name``."""
    whole = isinstance(value, int | np.integer) or (
        isinstance(value, float) and value.is_integer()
    )
    if isinstance(value, bool) or not whole:
        raise ValueError(f"Invalid {name}: {value!r} (expected an int)")
    if value < low:
        raise ValueError(f"Invalid {name}: {value} (must be >= {low})")
    return int(value)


@dataclass(frozen=True)
class RobustOptions:
    """The hyperparameters of this module's aggregators.

    Attributes
    ----------
    num_hostile : int (default: 1)
        f, the number of hostile updates Krum, multi-Krum and Bulyan assume
        (Flower's ``num_malicious_clients`` / ``num_malicious_nodes``).
    krum_keep : int (default: 0)
        m, the updates multi-Krum averages; 0 = n − f, every update but the
        f assumed hostile (our default: Flower's ``MultiKrum`` defaults to
        ``num_nodes_to_select=1``, which is Krum, and its legacy ``Krum`` to
        ``num_clients_to_keep=0``, also Krum).
    clip_radius : float (default: 0.0)
        τ of centered clipping; 0 = adaptive: in each iteration the median
        over the clients of ‖Δ_i − v‖ (our choice; the paper tunes τ).
    clip_iterations : int (default: 1)
        L, the iterations of centered clipping per round (the paper: one
        suffices from a good centre).
    """

    num_hostile: int = DEFAULT_NUM_HOSTILE
    krum_keep: int = 0
    clip_radius: float = 0.0
    clip_iterations: int = 1

    def __post_init__(self) -> None:
        """Validate (``ValueError`` naming the parameter) and normalise types."""
        object.__setattr__(
            self, "num_hostile", _check_int("num_hostile", self.num_hostile, 0)
        )
        object.__setattr__(
            self, "krum_keep", _check_int("krum_keep", self.krum_keep, 0)
        )
        object.__setattr__(
            self,
            "clip_iterations",
            _check_int("clip_iterations", self.clip_iterations, 1),
        )
        radius = self.clip_radius
        if (
            isinstance(radius, bool)
            or not isinstance(radius, int | float)
            or not math.isfinite(radius)
            or radius < 0
        ):
            raise ValueError(f"Invalid clip_radius: {radius!r} (finite, >= 0)")
        object.__setattr__(self, "clip_radius", float(radius))


@dataclass(frozen=True)
class Defence:
    """What a robust aggregator of this module did in one round.

    Attributes
    ----------
    aggregation : str
        The aggregator (one of :data:`AGGREGATIONS`).
    num_hostile : int | None
        The f the round used: ``num_hostile``, or the largest f its number
        of replies allows (:func:`usable_hostile`); 0 when it fell back to
        the coordinate-wise median. None for centered clipping (no f).
    selected : tuple[bool, ...] | None
        Per client (in the order given): whether its update entered Δ̄
        (Krum, multi-Krum, Bulyan's θ); None for centered clipping.
    center_scales : tuple[float, ...] | None
        Centered clipping: per client, min(1, τ/‖Δ_i − v‖) of the last
        iteration; None otherwise.
    radius : float | None
        Centered clipping: τ of the last iteration.
    center_origin : dict of str to array, or None
        Centered clipping: v_{L−1}, the centre its last iteration clipped
        around (:class:`CenteredClipping`); None otherwise.
    effective_sq_norms : tuple[float, ...] | None
        Centered clipping: each client's ‖e_i‖² over the rule's arrays,
        e_i = v_{L−1} + c_i (Δ_i − v_{L−1}); None otherwise or without A.
    fallback : str | None
        Why the round did not run the aggregator as configured, else None.
    """

    aggregation: str
    num_hostile: int | None = None
    selected: tuple[bool, ...] | None = None
    center_scales: tuple[float, ...] | None = None
    radius: float | None = None
    fallback: str | None = None
    center_origin: Arrays | None = field(default=None, compare=False, repr=False)
    effective_sq_norms: tuple[float, ...] | None = None


# --- Krum, multi-Krum, Bulyan -------------------------------------------------


def pairwise_sq_distances(stacks: Mapping[str, NDArray[Any]]) -> NDArray[np.float64]:
    """Return D with D_ij = ‖Δ_i − Δ_j‖² over every array, in float64.

    ``stacks[k]`` holds every client's update of array k (client on axis 0).
    Per array, ‖Δ_i‖² + ‖Δ_j‖² − 2⟨Δ_i, Δ_j⟩ from the float64 Gram matrix
    (one matrix product, not n² passes); small negative results of
    cancellation are set to 0 and D_ii = 0.
    """
    first = next(iter(stacks.values()))
    n = first.shape[0]
    dist = np.zeros((n, n))
    for stack in stacks.values():
        flat = np.asarray(stack, dtype=np.float64).reshape(n, -1)
        gram = flat @ flat.T
        sq = np.diag(gram)
        dist += sq[:, None] + sq[None, :] - 2.0 * gram
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


def krum_scores(dist: NDArray[Any], num_hostile: int) -> NDArray[np.float64]:
    """Return score(i) = Σ of D_ij over the n − f − 2 j ≠ i nearest to i.

    Blanchard et al. 2017, §4 (the Krum function). The count is at least 1,
    as Flower's ``max(1, n - f - 2)``; with one update left the score is 0.
    """
    n = dist.shape[0]
    closest = max(1, n - num_hostile - 2)
    scores = np.zeros(n)
    for i in range(n):
        others = np.sort(np.delete(dist[i], i))
        scores[i] = float(np.sum(others[:closest]))
    return scores


def krum_select(dist: NDArray[Any], num_hostile: int, keep: int) -> list[int]:
    """Return the indices of the ``keep`` smallest Krum scores, best first.

    ``keep = 1`` is Krum, ``keep = m`` multi-Krum (Blanchard et al. 2017,
    §4); ties go to the lower index.
    """
    scores = krum_scores(dist, num_hostile)
    return [int(i) for i in np.argsort(scores, kind="stable")[:keep]]


def bulyan_select(dist: NDArray[Any], num_hostile: int) -> list[int]:
    """Return Bulyan's θ = n − 2f selected indices, in the order Krum picked them.

    El Mhamdi et al. 2018, Algorithm 1 with Krum: θ times, Krum (with the
    same f) over the updates not yet selected, and its winner is removed.
    The scores are recomputed over the remaining updates each time, as the
    paper and Flower's legacy ``aggregate_bulyan`` (Flower's Message-API
    ``Bulyan`` instead keeps the θ best scores of one multi-Krum pass over
    all n: the same selection unless removing a winner reorders the rest).
    """
    remaining = list(range(dist.shape[0]))
    chosen: list[int] = []
    for _ in range(dist.shape[0] - 2 * num_hostile):
        sub = dist[np.ix_(remaining, remaining)]
        winner = remaining[int(np.argmin(krum_scores(sub, num_hostile)))]
        chosen.append(winner)
        remaining.remove(winner)
    return chosen


def bulyan_coordinates(stack: NDArray[Any], beta: int) -> NDArray[Any]:
    """Per coordinate, the mean of the ``beta`` values closest to their median.

    El Mhamdi et al. 2018, Algorithm 1, last step (β = θ − 2f); the median
    is NumPy's (the mean of the two middle values for an even count, as
    Flower's ``Bulyan``). ``stack`` holds the selected updates on axis 0.
    """
    median = np.median(stack, axis=0)
    nearest = np.argpartition(np.abs(stack - median), beta - 1, axis=0)[:beta]
    return np.mean(np.take_along_axis(stack, nearest, axis=0), axis=0)


def required_replies(aggregation: str, num_hostile: int) -> int:
    """Return the fewest replies ``aggregation`` needs with f = ``num_hostile``.

    Krum and multi-Krum: n > 2f + 2 (Blanchard et al. 2017, Proposition 1);
    Bulyan: n ≥ 4f + 3 (El Mhamdi et al. 2018, §4). Centered clipping: 1.
    """
    if aggregation == "bulyan":
        return 4 * num_hostile + 3
    if aggregation in ("krum", "multi_krum"):
        return 2 * num_hostile + 3
    return 1


def usable_hostile(aggregation: str, n: int, num_hostile: int) -> int | None:
    """Return the f a round of ``n`` replies uses; None: not even f = 0 fits.

    ``num_hostile`` when the round has enough replies, else the largest f
    it allows (our choice: a round that lost replies must not end a running
    federation, and a smaller f still screens out the worst outliers).
    With fewer than 3 replies (f = 0 needs 3) nothing singles an update out.
    """
    need = required_replies(aggregation, 0)
    if n < need:
        return None
    per_f = 4 if aggregation == "bulyan" else 2
    return min(num_hostile, (n - need) // per_f)


# --- centered clipping --------------------------------------------------------


class CenteredClipping(NamedTuple):
    """What :func:`centered_clipping` returns.

    ``update`` v_L; ``scales`` the last iteration's factors c_i; ``radius``
    its τ; ``mean_sq_norm`` A (None when not asked for); ``origin``
    v_{L−1}, the centre of the last iteration (v_0 with one iteration);
    ``effective_sq_norms`` each ‖e_i‖² over A's arrays (None with A).
    """

    update: Arrays
    scales: NDArray[np.float64]
    radius: float
    mean_sq_norm: float | None
    origin: Arrays
    effective_sq_norms: NDArray[np.float64] | None


def centered_clipping(
    stacks: Mapping[str, NDArray[Any]],
    center: Mapping[str, NDArray[Any]],
    radius: float,
    iterations: int,
    sq_norm_keys: Sequence[str] | None = None,
) -> CenteredClipping:
    """Return v_L, the last clip factors, τ and A of centered clipping.

    Karimireddy, He and Jaggi, ICML 2021, §4, eq. (CC), with v_0 = ``center``
    (their momentum; the previous round's aggregate) and the update of
    client i in place of its momentum::

        v_{l+1} = v_l + (1/n) Σ_i c_i (Δ_i − v_l),
        c_i = min(1, τ / ‖Δ_i − v_l‖)          (c_i = 1 when Δ_i = v_l)

    ``stacks[k]`` holds every client's update of array k on axis 0; the norm
    runs over every array. ``radius = τ > 0`` is fixed; 0 takes in each
    iteration τ_l = median_i ‖Δ_i − v_l‖ (our choice, no τ to tune: at most
    half of the clients are clipped, each to the median distance). Unweighted
    (1/n), as the paper.

    ``sq_norm_keys``: the arrays of A. A = (1/n) Σ_i ‖v_{L−1} + c_i (Δ_i −
    v_{L−1})‖² over them, the mean squared norm of each client's effective
    update in the last iteration (our choice: the A of FedExP/FedDuA must
    not let a clipped client's own norm back in; Δ̄ is their mean, so
    A ≥ ‖Δ̄‖² as with the plain mean). None: A is not computed (None).

    The last iteration is a plain mean: v_L = (1/n) Σ_i e_i with
    e_i = v_{L−1} + c_i (Δ_i − v_{L−1}), each client's effective update.
    The result keeps v_{L−1} and each ‖e_i‖², so that the step guard can
    leave one client out of it (:func:`~fedadapt.strategies.core.
    aggregation.leave_one_out`).
    """
    n = next(iter(stacks.values())).shape[0]
    v = {k: np.array(center[k], dtype=s.dtype).reshape(s.shape[1:])
         for k, s in stacks.items()}  # fmt: skip
    scales = np.ones(n)
    tau = radius
    mean_sq: float | None = None
    effective_sq: NDArray[np.float64] | None = None
    origin = v
    for step in range(iterations):
        sq = np.zeros(n)
        for k, s in stacks.items():
            diff = np.asarray(s - v[k], dtype=np.float64).reshape(n, -1)
            sq += np.einsum("ij,ij->i", diff, diff)
        dist = np.sqrt(sq)
        tau = radius if radius > 0 else float(np.median(dist))
        with np.errstate(divide="ignore", invalid="ignore"):
            scales = np.where(dist > tau, tau / dist, 1.0)
        last = step == iterations - 1
        if last and sq_norm_keys is not None:
            total = np.zeros(n)
            for k in sq_norm_keys:
                s = np.asarray(stacks[k], dtype=np.float64).reshape(n, -1)
                centre = np.asarray(v[k], dtype=np.float64).reshape(1, -1)
                effective = centre + scales[:, None] * (s - centre)
                total += np.einsum("ij,ij->i", effective, effective)
            mean_sq = float(np.mean(total))
            effective_sq = total
        origin = dict(v)
        for k, s in stacks.items():
            weights = (scales / n).astype(s.dtype)
            shift = np.tensordot(weights, s - v[k], axes=1)
            v[k] = np.asarray(v[k] + shift, dtype=s.dtype)
    return CenteredClipping(v, scales, float(tau), mean_sq, origin, effective_sq)


# --- one round ---------------------------------------------------------------


def update_stacks(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    adaptive: Sequence[str],
    scales: NDArray[Any] | None,
) -> Arrays:
    """Return every array's updates Δ_i = x_i − x_t stacked on axis 0.

    In the accumulator dtype (float32 stays float32, integers become
    floating point); the ``adaptive`` arrays are multiplied by the clip
    factors ``scales`` first (norm bounding precedes the robust aggregate).
    Holds n model-sized arrays, as Flower's Krum and Bulyan hold n models.
    """
    out: Arrays = {}
    for k, x_t in current.items():
        dtype = np.result_type(x_t.dtype, np.float32)
        stack = np.stack([np.subtract(c[k], x_t, dtype=dtype) for c in clients])
        if scales is not None and k in adaptive:
            stack *= scales.astype(dtype).reshape((-1,) + (1,) * x_t.ndim)
        out[k] = stack
    return out


def _sq_norms(stacks: Mapping[str, NDArray[Any]], keys: Sequence[str]) -> NDArray[Any]:
    """Return each client's Σ_k ‖Δ_i^k‖² over ``keys``, in float64."""
    n = next(iter(stacks.values())).shape[0]
    total = np.zeros(n)
    for k in keys:
        flat = np.asarray(stacks[k], dtype=np.float64).reshape(n, -1)
        total += np.einsum("ij,ij->i", flat, flat)
    return total


def robust_statistics(
    current: Mapping[str, NDArray[Any]],
    clients: Sequence[Mapping[str, NDArray[Any]]],
    weights: Sequence[float],
    adaptive: Sequence[str],
    scales: NDArray[Any] | None,
    aggregation: str,
    options: RobustOptions,
    center: Mapping[str, NDArray[Any]] | None = None,
    *,
    need_sq_norm: bool = True,
) -> tuple[Arrays, float | None, Defence]:
    """Return Δ̄, A (None unless ``need_sq_norm``) and what the defence did.

    ``weights`` are the rule's ω (uniform or by ``num-examples``), ``scales``
    the norm-bounding factors of the adaptive arrays (None: off). A is
    formed over the ``adaptive`` arrays (the rule's), Δ̄ over every array:

    - ``"krum"``: Δ̄ = the update of the smallest score; A = its ‖Δ_i‖².
    - ``"multi_krum"``: Δ̄ = Σ_{i∈S} ω_i Δ_i / Σ_{i∈S} ω_i over the m
      selected, A = Σ_{i∈S} ω_i ‖Δ_i‖² / Σ_{i∈S} ω_i: the rule's weights
      renormalised over the selected (Flower's ``MultiKrum`` averages the
      selected models by ``num-examples``; with uniform weighting, FedExP's
      and FedDuA's default, the plain mean). m = ``krum_keep`` or n − f,
      at most n − f.
    - ``"bulyan"``: Δ̄ per coordinate as :func:`bulyan_coordinates` over the
      θ selected (unweighted, as Flower's); A = the unweighted mean of
      their ‖Δ_i‖².
    - ``"centered_clipping"``: :func:`centered_clipping` from ``center``
      (None = zero, the first round), unweighted.

    A round with fewer replies than f needs (:func:`required_replies`)
    uses the largest f it allows (:func:`usable_hostile`, recorded in
    ``Defence.fallback``); with fewer than 3 replies, not enough for f = 0,
    Δ̄ is the coordinate-wise median (one reply: itself; two: their mean,
    as neither can be singled out) and A the median of the ‖Δ_i‖² (our
    choices: a round that lost replies must not end the run).
    """
    stacks = update_stacks(current, clients, adaptive, scales)
    n = len(clients)
    if aggregation == "centered_clipping":
        start = {k: np.zeros(s.shape[1:], s.dtype) for k, s in stacks.items()}
        if center is not None:
            start = {k: np.asarray(center[k]) for k in stacks}
        clipped = centered_clipping(
            stacks,
            start,
            options.clip_radius,
            options.clip_iterations,
            list(adaptive) if need_sq_norm else None,
        )
        sq = clipped.effective_sq_norms
        return (
            clipped.update,
            clipped.mean_sq_norm,
            Defence(
                aggregation,
                center_scales=tuple(clipped.scales.tolist()),
                radius=clipped.radius,
                center_origin=clipped.origin,
                effective_sq_norms=None if sq is None else tuple(sq.tolist()),
            ),
        )
    if aggregation not in SELECTIONS:
        raise ValueError(f"Invalid aggregation: {aggregation!r}")
    sq = _sq_norms(stacks, adaptive) if need_sq_norm else None
    hostile = usable_hostile(aggregation, n, options.num_hostile)
    if hostile is None:
        mean = {k: np.asarray(np.median(s, axis=0), s.dtype) for k, s in stacks.items()}
        reason = (
            f"{n} replies, fewer than the 3 {aggregation} needs even with "
            "num_hostile=0: coordinate-wise median"
        )
        mean_sq = None if sq is None else float(np.median(sq))
        return mean, mean_sq, Defence(aggregation, 0, (True,) * n, fallback=reason)
    reasons = []
    if hostile < options.num_hostile:
        need = required_replies(aggregation, options.num_hostile)
        reasons.append(
            f"{n} replies, fewer than the {need} {aggregation} needs with "
            f"num_hostile={options.num_hostile}: num_hostile={hostile} this round"
        )
    dist = pairwise_sq_distances(stacks)
    if aggregation == "bulyan":
        chosen = bulyan_select(dist, hostile)
        beta = len(chosen) - 2 * hostile
        mean = {
            k: np.asarray(bulyan_coordinates(s[chosen], beta), s.dtype)
            for k, s in stacks.items()
        }
        mean_sq = None if sq is None else float(np.mean(sq[chosen]))
    else:
        keep = 1 if aggregation == "krum" else options.krum_keep or n - hostile
        if keep > n - hostile:
            reasons.append(
                f"krum_keep={keep} > n - num_hostile = {n - hostile}: "
                f"averaging {n - hostile}"
            )
            keep = n - hostile
        chosen = krum_select(dist, hostile, keep)
        w = np.asarray(weights, dtype=np.float64)[chosen]
        w = w / w.sum()
        mean = {
            k: np.tensordot(w.astype(s.dtype), s[chosen], axes=1)
            for k, s in stacks.items()
        }
        mean_sq = None if sq is None else float(np.dot(w, sq[chosen]))
    picked = set(chosen)
    selected = tuple(i in picked for i in range(n))
    return (
        mean,
        mean_sq,
        Defence(aggregation, hostile, selected, fallback="; ".join(reasons) or None),
    )


@dataclass
class AggregatorState:
    """What the aggregation keeps across rounds.

    ``center`` is centered clipping's centre, the previous round's Δ̄ (every
    array), None before the first round. ``first_median_norm`` is the
    median update norm of the first round whose median was not zero, the
    anchor of the norm ceiling (``max_norm_growth`` of
    :func:`fedadapt.strategies.adapter.apply_rule`); None before it. Both
    are saved with the strategy's state (checkpoints).
    """

    center: Arrays | None = None
    first_median_norm: float | None = None

    def anchor_norm(self, typical: float | None) -> None:
        """Keep ``typical`` as the ceiling's anchor, if none is kept yet.

        A round's median update norm (None, zero or not finite: no anchor;
        the next round tries again).
        """
        if self.first_median_norm is not None or typical is None:
            return
        if typical > 0 and math.isfinite(typical):
            self.first_median_norm = float(typical)

    def norm_ceiling(self, growth: float) -> float | None:
        """Return g times the anchor (the norm ceiling), or None.

        None when ``growth`` g is 0 (off) or before the anchor is known.
        Every other bound of a round is relative to that round (its median
        norm, its median pull), so when every client's update grows, round
        after round, they grow with it; the ceiling does not. That growth
        is what three colluders of ten drove FedExP(M) and FedDuA to
        diverge by (docs/robustness.md, two and three hostile clients):
        their reversed updates steer the model where every client's next
        update is larger, and the adaptive step carries the larger updates
        further. Our addition (no paper states it); anchored in the first
        round because honest update norms rarely grow past their first
        round's (local training starts where the loss is highest).
        """
        if growth <= 0 or self.first_median_norm is None:
            return None
        return growth * self.first_median_norm

    def state_dict(self) -> dict[str, Any]:
        """Return the state (arrays by name; empty when nothing is kept)."""
        state: dict[str, Any] = {}
        if self.center is not None:
            state["center"] = {k: np.array(v) for k, v in self.center.items()}
        if self.first_median_norm is not None:
            state["first-median-norm"] = np.array(self.first_median_norm)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (empty: nothing kept)."""
        center = state.get("center")
        self.center = (
            None if center is None else {k: np.array(v) for k, v in center.items()}
        )
        anchor = state.get("first-median-norm")
        if anchor is not None:
            anchor = float(anchor)
            if not (anchor > 0 and math.isfinite(anchor)):  # a damaged state
                raise ValueError(
                    "aggregator state: first-median-norm must be a finite "
                    f"number > 0, got {anchor}"
                )
        self.first_median_norm = anchor
