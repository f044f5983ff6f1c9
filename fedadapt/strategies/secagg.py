"""Adaptive server steps under Flower's SecAgg+: what each side adds to it.

The adaptive rules need only two sums of a round (FedExP, arXiv:2301.09604,
Algorithm 1; FedDuA, Takakura et al., Algorithm 1 lines 9 and 12):

    Δ̄ = Σ_i ω_i Δ_i ,   A = Σ_i ω_i ‖Δ_i‖² ,   Δ_i = x_i − x_t ,

exactly what secure aggregation computes. Flower's SecAgg+ (legacy API
only: ``SecAggPlusWorkflow`` on the server, ``secaggplus_mod`` on the
client) masks the arrays a ``NumPyClient`` returns and reveals only their
weighted mean: the client multiplies its arrays by
``r_i = round(w_i / max_weight · Q) / Q`` (w_i its ``num_examples``),
clips each coordinate to ±c (``clipping_range``), maps it to an integer
in [0, Q] (``quantization_range``) by stochastic rounding and adds masks
modulo M (``modulus_range``); the server sums, removes the masks,
dequantises and divides by Σ r_i. ``aggregate_fit`` then receives one
(proxy, FitRes) per client whose parameters are all that one mean, and
each client's metrics and ``num_examples`` in the clear.

So a fedadapt client in this mode (:func:`encode_update`) returns, instead
of its model, its update Δ_i (array by array) followed by two one-element
arrays, its norm entry and its clip flag: all are scaled by the same r_i,
so the mean the server receives is [Δ̄, Ā_entry, share clipped] in one
weighting ω_i = r_i / Σ_j r_j. It sends ``num_examples`` = 1 under uniform
weighting (with ``max_weight`` = 1: r_i = 1 exactly) and its example count
under ``num-examples`` weighting. The norm leaves the clear metrics (a
metric is not masked). The server (:func:`decode_sums`) splits the mean
into Δ̄ and A and the rule steps on them; no individual update or norm
exists on the server, so per-client screening, the server's norm bound,
the weight cap, the step guard and robust aggregation cannot run.

What replaces the server's norm bound: a bound B_t the server sends
(:data:`~fedadapt.strategies.wire.SECAGG_NORM_BOUND`; the legacy strategy sets
B_{t+1} = k·m_t, k = ``max_update_norm_ratio`` and m_t the clients' weighted
median norm from the norm histogram each appends
(:func:`median_from_histogram`), at most ``max_update_norm``). An honest client
clips its update to B_t before masking, Δ_i ← Δ_i·min(1, B_t/‖Δ_i‖), and sends
its norm as the coordinate c·(2‖Δ_i‖²/B_t² − 1) of [−c, c]
(:func:`encode_in_range`), whose mean decodes to A (:func:`decode_in_range`).
Flower's mod clips every coordinate to ±c, so a client that lies about its norm
moves A by at most ω_i·B_t² (its entry cannot leave [0, B_t²]); and since
Jensen's check (A ≥ ‖Δ̄‖²) must still hold, a client that sends a large Δ_i
with a small norm fails the round instead of moving the model by more than B_t.
The clip flag (c when the client clipped, else 0) tells the server the weighted
share of clients the bound clipped, and nothing per client. Round 1 has no
median yet: its bound is ``max_update_norm``; with none (0) the norm travels as
is, and the legacy strategy makes round 1 a calibration round that does not
step (no reply is bounded yet). Under a bound every reply is also bounded in
L2, by the rotated block (:func:`rotate`, ``coordinate_bound``), and under
num-examples weighting its weight by the cap the server sends
(:func:`next_weight_cap`).

A local update whose server half needs only the mean of its clients'
arrays (:meth:`~fedadapt.strategies.local_update.LocalUpdate.summable`:
Fed-LAMB's second moments, v̂ = max(v̂, Σω_i v_i)) has them appended after
the clip flag, each in the range the server sends for it
(:data:`~fedadapt.strategies.wire.SECAGG_LOCAL_RANGES`), their names in the
clear metrics; the server decodes their mean with Δ̄ and A.

Overflow is never silent. A coordinate beyond ±c would be clipped by
Flower without notice, so the client counts its scaled coordinates beyond
c before masking and reports the count in its clear metrics
(:data:`~fedadapt.strategies.wire.SECAGG_CLIPPED`, 0 when nothing would be
clipped; a weight above ``max_weight`` counts too); the server rejects the
round's aggregate when any count is non-zero or when n·Q ≥ M (the masked
sum could wrap), naming the setting to change (:func:`aggregate_problem`).

Error bound. Stochastic rounding moves each client's scaled coordinate by
less than one quantisation step q = 2c/Q, so each coordinate of the
revealed mean (Δ̄, or the norm entry) differs from the exact r-weighted mean
by less than

    e = n · q / Σ_i r_i        (= 2c/Q under uniform weighting),

(:meth:`SecAggPlusSettings.error_bound`) up to float64 rounding; A itself,
decoded from the norm entry, within e·B_t²/(2c) under a bound B_t. Under
``num-examples`` weighting the weights themselves are r_i, which differ
from w_i / max_weight by at most 1/(2Q).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedadapt._validation import check_scalar
from fedadapt.strategies import wire
from fedadapt.strategies.core.aggregation import Arrays, RoundStatistics, sq_norm

#: Values of run-config ``secure-aggregation`` (and of the strategies'
#: ``secure_aggregation`` when given as a string).
SECURE_AGGREGATION_MODES = ("off", "secagg+", "trust-reported-norms")

#: κ of :class:`SecAggPlusSettings`: each rotated coordinate within ±κ·B/√D
COORDINATE_BOUND = 1.0


def secure_aggregation_mode(value: bool | str) -> str:
    """Return the mode of a ``secure_aggregation`` argument.

    For the strategy classes a bool keeps its earlier meaning: True is
    ``"trust-reported-norms"`` (use the clients' reported norms as given;
    nothing is masked), False is ``"off"``. Real SecAgg+ is the string
    ``"secagg+"`` with a :class:`SecAggPlusSettings` (``secagg=``).
    """
    if isinstance(value, bool):
        return "trust-reported-norms" if value else "off"
    if value not in SECURE_AGGREGATION_MODES:
        raise ValueError(
            f"Invalid secure_aggregation: {value!r} "
            f"(one of {', '.join(SECURE_AGGREGATION_MODES)}, or a bool)"
        )
    return value


@dataclass(frozen=True)
class SecAggPlusSettings:
    """The quantisation and sharing parameters of one SecAgg+ run.

    Attributes
    ----------
    clipping_range : float
        c: every scaled coordinate (of Δ_i and of ‖Δ_i‖²) must lie in
        [−c, c]; Flower clips it there otherwise (here: the round fails).
    quantization_range : int
        Q: a coordinate becomes an integer in [0, Q]; the step is 2c/Q.
    modulus_range : int
        M, a power of two: the masked sum of n clients stays exact while
        n·Q < M.
    max_weight : float
        Flower's ``max_weight``: r_i = w_i / max_weight. 1 under uniform
        weighting (every client sends w_i = 1).
    num_shares, reconstruction_threshold : float
        Flower's fractions: shares per client as a fraction of the sampled
        clients, and the fraction of those needed to unmask.
    coordinate_bound : float
        κ: under a norm bound B_t each client sends its update rotated
        (:func:`rotate`), every coordinate within ±κ·B_t/√D, so that no
        reply, honest or not, carries more than κ·B_t in L2 (0: not
        rotated; a hostile update is then bounded only by c per
        coordinate and by Jensen's check on the sums).
    step_guard : bool
        Cap FedExP's and FedDuA's step at the worst case of one client
        removed (:func:`guard_on_sums`): no client within the bounds can
        raise it, at a measured cost to honest runs (docs/robustness.md).
    """

    clipping_range: float = 8.0
    quantization_range: int = 1 << 22
    modulus_range: int = 1 << 32
    max_weight: float = 1.0
    num_shares: float = 1.0
    reconstruction_threshold: float = 0.5
    coordinate_bound: float = COORDINATE_BOUND
    step_guard: bool = False

    def __post_init__(self) -> None:
        """Check the ranges as Flower's workflow would, and more strictly."""
        check_scalar("clipping_range", self.clipping_range, low=0, low_inclusive=False)
        check_scalar("coordinate_bound", self.coordinate_bound, low=0)
        check_scalar("max_weight", self.max_weight, low=0, low_inclusive=False)
        check_scalar("num_shares", self.num_shares, low=0, high=1, low_inclusive=False)
        check_scalar(
            "reconstruction_threshold",
            self.reconstruction_threshold,
            low=0,
            high=1,
            low_inclusive=False,
        )
        q, m = self.quantization_range, self.modulus_range
        if not isinstance(q, int) or not 0 < q < 1 << 31:
            raise ValueError(f"Invalid quantization_range: {q} (an int in [1, 2^31))")
        if not isinstance(m, int) or m <= q or m & (m - 1) or m > 1 << 62:
            raise ValueError(
                f"Invalid modulus_range: {m} (a power of two above "
                f"quantization_range = {q}, at most 2^62)"
            )

    @property
    def step(self) -> float:
        """The quantisation step q = 2c/Q of one scaled coordinate."""
        return 2 * self.clipping_range / self.quantization_range

    @property
    def max_clients(self) -> int:
        """The most clients whose masked sum cannot wrap: n·Q < M."""
        return (self.modulus_range - 1) // self.quantization_range

    def weight_ratio(self, weight: float) -> float:
        """Return r = round(w / max_weight · Q) / Q, the factor of the arrays."""
        q = self.quantization_range
        return round(weight / self.max_weight * q) / q

    def error_bound(self, weights: Sequence[float]) -> float:
        """Return e = n·q / Σ r_i, the bound on each revealed coordinate's error.

        ``weights`` are the clients' w_i (their ``num_examples``).
        """
        total = sum(self.weight_ratio(w) for w in weights)
        return len(weights) * self.step / total if total > 0 else math.inf

    def fit_config(
        self,
        uniform: bool,
        norm_bound: float = 0.0,
        rotation_seed: int = 0,
        weight_cap: float = 0.0,
        histogram: bool = False,
    ) -> dict[str, float | int]:
        """Return what a client needs to encode and check its update.

        ``norm_bound``: B_t, the L2 norm each client clips its update to
        (0: none this round); under one, the update is sent rotated with
        ``rotation_seed`` (unless ``coordinate_bound`` is 0).
        ``weight_cap`` (num-examples weighting; 0: none): the most weight a
        client sends (:func:`next_weight_cap`). ``histogram``: the clients
        append their norm histogram (:func:`median_from_histogram`).
        """
        config: dict[str, float | int] = {
            wire.SECAGG_CLIPPING_RANGE: self.clipping_range,
            wire.SECAGG_QUANTIZATION_RANGE: self.quantization_range,
            wire.SECAGG_MAX_WEIGHT: self.max_weight,
            wire.SECAGG_UNIFORM: int(uniform),
            wire.SECAGG_NORM_BOUND: float(norm_bound),
        }
        if norm_bound > 0 and self.coordinate_bound > 0:
            config[wire.SECAGG_COORDINATE_BOUND] = self.coordinate_bound
            config[wire.SECAGG_ROTATION_SEED] = int(rotation_seed)
        if weight_cap > 0 and not uniform:
            config[wire.SECAGG_WEIGHT_CAP] = float(weight_cap)
        if histogram:
            config[wire.SECAGG_NORM_HISTOGRAM] = 1
        return config

    @classmethod
    def from_fit_config(cls, config: Mapping[str, Any]) -> SecAggPlusSettings | None:
        """Return the settings a fit config carries, or None (not SecAgg+)."""
        if wire.SECAGG_CLIPPING_RANGE not in config:
            return None
        q = int(config[wire.SECAGG_QUANTIZATION_RANGE])
        return cls(
            clipping_range=float(config[wire.SECAGG_CLIPPING_RANGE]),
            quantization_range=q,
            modulus_range=1 << 62,  # not the client's concern
            max_weight=float(config[wire.SECAGG_MAX_WEIGHT]),
            coordinate_bound=float(config.get(wire.SECAGG_COORDINATE_BOUND, 0.0)),
        )


def next_norm_bound(
    current: float,
    mean_sq_norm: float | None,
    max_norm: float,
    max_norm_ratio: float,
    median_norm: float | None = None,
    ceiling: float | None = None,
) -> float:
    """Return B_{t+1} = min(C, k·m_t, ceiling), the next round's clients' bound.

    The plain mode's bound is k times the round's median norm; under SecAgg+
    the server has the weighted median m_t from the norm histogram
    (``median_norm``, :func:`median_from_histogram`), or else the root mean
    square √A_t (≥ the clients' mean norm, and a false claim inflates it),
    so the clients of the next round clip to k·m_t (k = ``max_norm_ratio``),
    and to C = ``max_norm`` when that is smaller (0: none). A round whose
    clients did not move (A = 0, or nothing known) keeps ``current``. 0
    means no bound. ``ceiling`` (None: none) is the norm ceiling of
    ``max_update_norm_growth`` (g times the first measured typical norm,
    :func:`typical_norm` and :meth:`~fedadapt.strategies.core.robust.
    AggregatorState.norm_ceiling`): the bound k·m_t follows the clients'
    norms when they all grow, the ceiling does not.
    """
    bounds = [max_norm] if max_norm > 0 else []
    if max_norm_ratio > 0:
        typical = typical_norm(mean_sq_norm, median_norm)
        if typical is None:
            return current
        bounds.append(max_norm_ratio * typical)
    if ceiling is not None and ceiling > 0:
        bounds.append(ceiling)
    return min(bounds) if bounds else 0.0


def typical_norm(
    mean_sq_norm: float | None, median_norm: float | None = None
) -> float | None:
    """Return a SecAgg+ round's typical update norm, or None when unknown.

    The weighted median of the norm histogram when the clients sent one,
    else √A (≥ the clients' mean norm); None when neither is positive.
    """
    typical = median_norm
    if typical is None and mean_sq_norm is not None and mean_sq_norm > 0:
        typical = math.sqrt(mean_sq_norm)
    return typical if typical is not None and typical > 0 else None


def _walsh_hadamard(vector: NDArray[np.float64]) -> NDArray[np.float64]:
    """Return H·v/√D for a vector of length D = 2^m (orthonormal, self-inverse)."""
    size = vector.size
    out = vector.copy()
    half = 1
    while half < size:
        pairs = out.reshape(-1, 2, half)
        out = np.stack((pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]), axis=1)
        half *= 2
    return out.reshape(size) / math.sqrt(size)


def rotated_size(size: int) -> int:
    """Return D, the power of two a vector of ``size`` coordinates is padded to."""
    return 1 << max(size - 1, 0).bit_length()


def _signs(seed: int, size: int) -> NDArray[np.float64]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2, size).astype(np.float64) * 2 - 1


def rotate(vector: NDArray[Any], seed: int) -> NDArray[np.float64]:
    """Return R·v: ``vector`` padded with zeros to D = 2^m, then H·S/√D.

    S is a diagonal of random signs drawn from ``seed`` and H the
    Walsh–Hadamard matrix: an orthogonal map (‖R·v‖ = ‖v‖) after which
    every coordinate of a fixed v is about ‖v‖/√D, Gaussian-like (the
    "flattening" of Kairouz, Liu and Steinke, ICML 2021, §4, before modular
    clipping). A bound c' per rotated coordinate then bounds the L2 norm of
    *any* vector by c'·√D, while an honest vector of norm ≤ B loses almost
    nothing to c' = κ·B/√D (the share of its coordinates beyond κ
    standard deviations).
    """
    flat = np.asarray(vector, np.float64).reshape(-1)
    padded = np.zeros(rotated_size(flat.size))
    padded[: flat.size] = flat
    return _walsh_hadamard(_signs(seed, padded.size) * padded)


def unrotate(rotated: NDArray[Any], seed: int, size: int) -> NDArray[np.float64]:
    """Return the first ``size`` coordinates of Rᵀ·y (the inverse of :func:`rotate`)."""
    y = np.asarray(rotated, np.float64).reshape(-1)
    return (_signs(seed, y.size) * _walsh_hadamard(y))[:size]


def coordinate_scale(norm_bound: float, coordinate_bound: float, size: int) -> float:
    """Return s = κ·B/√D, the bound on each rotated coordinate of a reply."""
    return coordinate_bound * norm_bound / math.sqrt(rotated_size(size))


def rotated_indices(config: Mapping[str, Any], trainable: Sequence[bool]) -> list[int]:
    """Return the indices of the arrays a client sends rotated ([]: none).

    Under a bound B_t and a κ > 0 in the fit config, the ``trainable``
    arrays (those the norm is summed over and the bound clips) travel as
    one rotated block; the others (integer counters, float buffers) as
    they are.
    """
    bound = float(config.get(wire.SECAGG_NORM_BOUND, 0.0))
    kappa = float(config.get(wire.SECAGG_COORDINATE_BOUND, 0.0))
    if bound <= 0 or kappa <= 0:
        return []
    return [j for j, counted in enumerate(trainable) if counted]


def next_weight_cap(
    counts: Sequence[float], max_weight: float, max_weight_ratio: float
) -> float:
    """Return the weight cap of the next round: min(max_weight, k·median count).

    Under SecAgg+ the server cannot re-weight a reply, so the weight cap of
    the plain path (k = ``max_weight_ratio`` times the round's median
    ``num-examples``, a client's own claim) is sent to the clients instead:
    each sends min(num-examples, cap), and a clear count above it fails the
    round (:func:`aggregate_problem`). ``counts`` are this round's clear
    counts (already capped: the median of min(n_i, cap) is that of n_i while
    cap ≥ the median). ``max_weight`` (Flower's, r_i ≤ 1) when k is 0 or no
    count is known.
    """
    if max_weight_ratio <= 0 or not counts:
        return max_weight
    return min(max_weight, max_weight_ratio * float(np.median(counts)))


#: Arrays after Δ_i's in a client's masked reply: its norm entry, its clip flag
#: (then, when the round asks for it, its norm histogram: one array more)
EXTRA_ARRAYS = 2

#: The norm histogram's thresholds τ_j = NORM_LEVEL_LOW · NORM_LEVEL_RATIO^j,
#: j < NORM_LEVELS: ‖Δ‖ from 1e-6 to about 4e3 in steps of 2^(1/4) (19 %)
NORM_LEVEL_LOW = 1e-6
NORM_LEVEL_RATIO = 2**0.25
NORM_LEVELS = 128


def norm_levels() -> NDArray[np.float64]:
    """Return the thresholds τ_j of the norm histogram (:func:`encode_update`)."""
    return np.asarray(
        NORM_LEVEL_LOW * NORM_LEVEL_RATIO ** np.arange(NORM_LEVELS), np.float64
    )


def median_from_histogram(shares: Sequence[float]) -> float | None:
    """Return the weighted median update norm from the shares above each τ_j.

    ``shares``: the revealed weighted share of clients whose ‖Δ_i‖ exceeds
    τ_j, for each threshold (non-increasing for honest clients). The median
    is the first τ_j with at most half the weight above it: within one step
    (19 %) above the true weighted median. A client's entries lie in [0, 1]
    (Flower's ±c), so a hostile one moves each share by at most its weight
    ω: the estimate stays between the (50 − 100ω)-th and (50 + 100ω)-th
    percentiles of the honest norms, whatever it sends (k·√A instead grows
    with a false norm claim). None when no threshold has half the weight
    below it (all norms above the last level).
    """
    levels = norm_levels()
    for level, share in zip(levels, shares, strict=False):
        if share <= 0.5:
            return float(level)
    return None


def encode_in_range(value: Any, top: float, clipping_range: float) -> Any:
    """Return the coordinates that carry ``value`` (≥ 0) in the masked reply.

    With ``top`` > 0: c·(2·value/top − 1), which maps [0, top] onto [−c, c]
    (Flower's mod clips any coordinate to ±c, so whatever a client claims,
    its entry decodes into [0, top]; all of Q's steps span the range). The
    norm entry uses top = B² (the round's bound squared), Fed-LAMB's
    moments top = the server's range per array. Without one (0): the value
    itself.
    """
    if top > 0:
        return clipping_range * (2 * np.asarray(value, np.float64) / top - 1)
    return value


def decode_in_range(entry: Any, top: float, clipping_range: float) -> Any:
    """Return the weighted mean of values from the mean of their entries.

    The inverse of :func:`encode_in_range`: the entry is linear in the value
    with the same offset for every client, and the revealed mean has
    weights summing to 1, so the mean entry decodes to the mean value.
    """
    if top > 0:
        return (np.asarray(entry, np.float64) / clipping_range + 1) * top / 2
    return entry


def encode_update(
    sent: Sequence[NDArray[Any]],
    trained: Sequence[NDArray[Any]],
    update_sq_norm: float,
    num_examples: int,
    config: Mapping[str, Any],
    trainable: Sequence[bool] | None = None,
    local: Mapping[str, NDArray[Any]] | None = None,
) -> tuple[list[NDArray[Any]], int, int]:
    """Return (arrays to mask, weight to send, coordinates Flower would clip).

    The arrays are Δ_i = x_i − x_t (float64), then [norm entry] and [clip
    flag] (:data:`EXTRA_ARRAYS`), then the ``local`` update's arrays in
    their order (Fed-LAMB's v), each in the range the server sent for it
    (:data:`~fedadapt.strategies.wire.SECAGG_LOCAL_RANGES`,
    :func:`encode_in_range`). Under the round's bound B > 0
    (:data:`~fedadapt.strategies.wire.SECAGG_NORM_BOUND`) an update with
    ‖Δ_i‖ > B is clipped first: the ``trainable`` arrays (those
    ``update_sq_norm`` was summed over; None: every floating array) are
    multiplied by B/‖Δ_i‖ and the norm becomes B²; the flag is c then,
    else 0. In a round without a bound where the server asks for the norm
    histogram (the legacy strategy's calibration round, which does not step
    and takes the next bound from the histogram) a ‖Δ_i‖² beyond c goes as
    c, flagged like a clip: A is then a lower bound, which that round does
    not use (Fed-LAMB's updates on digits-mlp have ‖Δ_i‖² of 14–24 in round
    1: with c = 8 the suite refused all 20 honest rounds). Under a bound
    and a κ > 0 (:func:`rotated_indices`) the trainable arrays then go as
    one block, :func:`rotate`'d with the round's seed, each coordinate
    clipped to ±κ·B/√D
    (:func:`coordinate_scale`: an honest update loses only the share of
    its coordinates beyond κ standard deviations) and mapped onto ±c, in
    place of those arrays; the client declares their indices in its clear
    metrics (:data:`~fedadapt.strategies.wire.SECAGG_ROTATED`).
    The weight is 1 under uniform weighting, else ``num_examples``, at
    most the round's weight cap
    (:data:`~fedadapt.strategies.wire.SECAGG_WEIGHT_CAP`).
    The count is the number of coordinates of r·arrays beyond ±c (plus one
    when the weight exceeds ``max_weight``): the client's own check before
    masking, since Flower clips silently.
    """
    settings = SecAggPlusSettings.from_fit_config(config)
    if settings is None:
        raise ValueError("not a SecAgg+ fit config")
    weight = 1 if int(config[wire.SECAGG_UNIFORM]) else int(num_examples)
    cap = float(config.get(wire.SECAGG_WEIGHT_CAP, 0.0))
    if cap > 0:
        weight = min(weight, max(1, math.floor(cap)))
    c = settings.clipping_range
    bound = float(config.get(wire.SECAGG_NORM_BOUND, 0.0))
    arrays = [
        np.subtract(x, s, dtype=np.float64) for s, x in zip(sent, trained, strict=True)
    ]
    if trainable is None:
        trainable = [np.asarray(x).dtype.kind == "f" for x in sent]
    true_sq_norm = update_sq_norm  # before the clip: the histogram's
    clipped_to_bound = bound > 0 and update_sq_norm > bound**2
    if clipped_to_bound:
        scale = bound / math.sqrt(update_sq_norm)
        arrays = [
            a * scale if counted else a
            for a, counted in zip(arrays, trainable, strict=True)
        ]
        update_sq_norm = bound**2  # exactly: its entry is c, never beyond
    rotated = rotated_indices(config, trainable)
    if rotated:
        block = rotate(
            np.concatenate([arrays[j].reshape(-1) for j in rotated]),
            int(config[wire.SECAGG_ROTATION_SEED]),
        )
        scale = coordinate_scale(bound, settings.coordinate_bound, block.size)
        others = [a for j, a in enumerate(arrays) if j not in set(rotated)]
        arrays = [np.clip(block / scale, -1.0, 1.0) * c, *others]
    histogram = bool(int(config.get(wire.SECAGG_NORM_HISTOGRAM, 0)))
    # a calibration round (no bound yet, the histogram asked for): the server
    # does not step and takes the next bound from the histogram, so a norm
    # entry beyond ±c is capped (and flagged) instead of refusing the round
    capped_entry = bound <= 0 and histogram and update_sq_norm > c
    entry = encode_in_range(min(update_sq_norm, c) if capped_entry else update_sq_norm,
                            bound**2, c)  # fmt: skip
    arrays.append(np.array([entry], np.float64))
    flagged = clipped_to_bound or capped_entry
    arrays.append(np.array([c if flagged else 0.0], np.float64))
    if histogram:
        above = (norm_levels() < math.sqrt(max(true_sq_norm, 0.0))).astype(np.float64)
        arrays.append(np.asarray(encode_in_range(above, 1.0, c), np.float64))
    ranges = local_ranges(config)
    for name, values in (local or {}).items():
        top = entry_for(name, ranges, 0.0)
        arrays.append(np.asarray(encode_in_range(values, top, c), np.float64))
    ratio = settings.weight_ratio(weight)
    # beyond ±c, and NaN/Inf (which Flower's quantiser would turn into
    # arbitrary integers: a silently wrong sum): both refuse the round
    clipped = sum(int(np.count_nonzero(~(np.abs(a * ratio) <= c))) for a in arrays)
    clipped += int(weight > settings.max_weight)
    return arrays, weight, clipped


def local_ranges(config: Mapping[str, Any]) -> dict[str, float]:
    """Return the ranges a fit config gives local-update arrays ({} if none)."""
    raw = config.get(wire.SECAGG_LOCAL_RANGES)
    if not raw:
        return {}
    ranges = json.loads(str(raw))
    return {str(k): float(v) for k, v in ranges.items()}


def local_scales(config: Mapping[str, Any]) -> dict[str, str]:
    """Return the scales a fit config gives local-update arrays ({} if none)."""
    raw = config.get(wire.SECAGG_LOCAL_SCALES)
    if not raw:
        return {}
    return {str(k): str(v) for k, v in json.loads(str(raw)).items()}


def entry_for(name: str, table: Mapping[str, Any], default: Any) -> Any:
    """Return ``name``'s entry in a table of local ranges or scales.

    Its own, else that of the longest key ending in ``*`` that ``name``
    starts with (``*``: every array; a composite local update's member
    ``fed-lamb/*``), else ``default``. Before v̂ exists the server may not
    know the names of the clients' arrays.
    """
    if name in table:
        return table[name]
    wild = [k for k in table if k.endswith("*") and name.startswith(k[:-1])]
    return table[max(wild, key=len)] if wild else default


#: The log scale's floor: ln(max(v, floor)/floor) travels, so a value at or
#: below it decodes to it (Fed-LAMB's v̂ is at least ε = 1e-8 anyway)
LOG_SCALE_FLOOR = 1e-12


def to_secure_scale(
    local: Mapping[str, NDArray[Any]],
    config: Mapping[str, Any],
    reference: Mapping[str, NDArray[Any]] | None = None,
) -> dict[str, NDArray[Any]]:
    """Return a client's local-update arrays in the scales the server sent.

    ``ratio``: v / max(ref, floor), coordinate by coordinate, ``reference``
    being what the server sent this round (Fed-LAMB's v̂); ``log``:
    ln(max(v, floor)/floor) (:data:`LOG_SCALE_FLOOR`); no scale: as is. The
    ranges then bound the transformed value ([0, top]), which is what
    bounds a hostile client (see :meth:`~fedadapt.strategies.fedlamb.
    SecondMoments.secure_scales`). Non-finite values are left as they are,
    for the overflow count to refuse. Raises ValueError when a ratio has no
    reference of the array's shape.
    """
    scales = local_scales(config)
    out: dict[str, NDArray[Any]] = {}
    for name, values in local.items():
        a = np.asarray(values, np.float64)
        scale = entry_for(name, scales, "")
        if scale == "" or not np.all(np.isfinite(a)):
            out[name] = np.asarray(values)
        elif scale == "log":
            out[name] = np.log(np.maximum(a, LOG_SCALE_FLOOR) / LOG_SCALE_FLOOR)
        elif scale == "ratio":
            ref = (reference or {}).get(name)
            if ref is None or np.shape(ref) != a.shape:
                raise ValueError(f"no reference of its shape for the ratio of '{name}'")
            out[name] = a / np.maximum(np.asarray(ref, np.float64), LOG_SCALE_FLOOR)
        else:
            raise ValueError(f"unknown secure scale {scale!r} for '{name}'")
    return out


def from_secure_scale(
    mean: NDArray[Any], scale: str, reference: NDArray[Any] | None = None
) -> NDArray[np.float64]:
    """Return the mean value from the revealed mean in ``scale``.

    The inverse of :func:`to_secure_scale` on a mean: ``ratio`` is linear
    (the weights sum to 1), so mean·max(ref, floor) is the weighted mean of
    the values, exactly; ``log`` gives floor·exp(mean), their weighted
    geometric mean.
    """
    m = np.asarray(mean, np.float64)
    if scale == "log":
        return LOG_SCALE_FLOOR * np.exp(m)
    if scale == "ratio":
        if reference is None:
            raise ValueError("a ratio's mean needs its reference")
        return m * np.maximum(np.asarray(reference, np.float64), LOG_SCALE_FLOOR)
    return m


def hold_to_ranges(
    local: Mapping[str, NDArray[Any]], config: Mapping[str, Any]
) -> tuple[dict[str, NDArray[Any]], bool]:
    """Return the local-update arrays held to the server's ranges, and a cut.

    The flag is True when some coordinate was cut. An honest client's v can
    outgrow the range the server sent (a client that alone holds a coordinate
    has up to n times the mean there, and v grows between rounds): on digits-mlp
    Fed-LAMB's v reached 18× its array's max v̂ in round 2 against a range of
    4×. Counted as an overflow, that refused the round (1–2 rounds of each
    honest run, issue #38), and a client that lies about it could refuse every
    round. Held to [0, top] instead, the value is what the encoding could carry
    anyway, the round goes on, and the client says so (``secagg-local-clipped``,
    a diagnostic: since stop 65 the ranges are per coordinate and never
    widened, see :meth:`~fedadapt.strategies.fedlamb.SecondMoments.
    secure_scales`). Arrays without a range, and non-finite values (an
    overflow, as before), are left as they are. Call it on the values in
    their scale (:func:`to_secure_scale`).
    """
    ranges = local_ranges(config)
    held: dict[str, NDArray[Any]] = {}
    cut = False
    for name, values in local.items():
        top = entry_for(name, ranges, 0.0)
        a = np.asarray(values)
        if top > 0 and np.all(np.isfinite(a)):
            kept = np.clip(a, 0.0, top).astype(a.dtype)
            cut = cut or bool(np.any(kept != a))
            held[name] = kept
        else:
            held[name] = a
    return held, cut


def reported_count(value: Any) -> int | None:
    """Return a client's clear ``secagg-clipped`` as a count, or None.

    None when it is no finite number (missing, a string, NaN): refused as
    missing, never a crash of the round.
    """
    if isinstance(value, int | float) and math.isfinite(value):
        return int(value)
    return None


def aggregate_problem(
    settings: SecAggPlusSettings,
    clipped: Mapping[str, Any],
    counts: Mapping[str, float] | None = None,
    weight_cap: float = 0.0,
) -> str | None:
    """Why a round's SecAgg+ aggregate cannot be used, or None.

    ``clipped`` maps each client (node) to its reported
    :data:`~fedadapt.strategies.wire.SECAGG_CLIPPED` (None: missing);
    ``counts`` to the weight it sent in the clear, which may not exceed
    ``weight_cap`` (0: no cap; see :func:`next_weight_cap`).
    """
    n = len(clipped)
    over_cap = {
        k: v for k, v in (counts or {}).items() if weight_cap > 0 and v > weight_cap
    }
    if over_cap:
        listed = ", ".join(f"node {k}: {v:g}" for k, v in sorted(over_cap.items()))
        return (
            f"weights above the cap {weight_cap:g} the server sent ({listed}): "
            "an honest client sends min(num-examples, cap)"
        )
    if n > settings.max_clients:
        return (
            f"{n} clients but the masked sum is exact only for n·Q < M "
            f"(at most {settings.max_clients}): raise secagg-modulus-range or "
            "lower secagg-quantization-range"
        )
    counted = {k: reported_count(v) for k, v in clipped.items()}
    missing = sorted(str(k) for k, v in counted.items() if v is None)
    if missing:
        return (
            f"nodes {', '.join(missing)} sent no (finite) {wire.SECAGG_CLIPPED}: not "
            "fedadapt clients in secagg+ mode, the aggregate cannot be checked"
        )
    over = {k: v for k, v in counted.items() if v is not None and v > 0}
    if over:
        listed = ", ".join(f"node {k}: {v}" for k, v in sorted(over.items()))
        return (
            f"coordinates beyond ±{settings.clipping_range:g} after scaling "
            f"({listed}); SecAgg+ would clip them and the sum would be wrong: "
            "raise secagg-clipping-range (or secagg-max-weight, if a weight "
            "exceeded it)"
        )
    return None


def refusing_nodes(
    clipped: Mapping[str, Any],
    counts: Mapping[str, float] | None = None,
    weight_cap: float = 0.0,
) -> list[str]:
    """Return the nodes whose own clear metrics refuse the round.

    Those :func:`aggregate_problem` refuses it for: a missing or non-zero
    clip count, a weight above the cap. The masked sum cannot be taken
    apart, so such a reply spoils the whole round, and a hostile client can
    send one every round (a false ``secagg-clipped``, or a weight over the
    cap) until the run ends after ``max-failed-rounds``. These are the
    replies the server can name.
    """
    counted = {k: reported_count(v) for k, v in clipped.items()}
    named = {k for k, v in counted.items() if v is None or v > 0}
    named |= {k for k, v in (counts or {}).items() if weight_cap > 0 and v > weight_cap}
    return sorted(named)


@dataclass(frozen=True)
class DecodedSums:
    """What one SecAgg+ round reveals, decoded (:func:`decode_sums`).

    Attributes
    ----------
    stats : RoundStatistics
        Δ̄ and A, the sums the rule steps on.
    clipped_share : float
        Σω_i over the clients that clipped their update to the round's
        bound: the share of the round's weight (under uniform weighting, of
        its clients) that the bound clipped.
    local_mean : Arrays
        Σω_i of each local-update array (Fed-LAMB: Σω_i v_i), by name.
    median_norm : float | None
        The clients' weighted median ‖Δ_i‖ from their norm histogram
        (:func:`median_from_histogram`); None without one.
    impossible : str | None
        Why Δ̄ and A cannot come from honest clients, where
        :func:`decode_sums` returned them anyway (``tolerate_impossible``);
        None when they passed its checks.
    norm_shares : tuple[float, ...] | None
        The revealed norm histogram: the weighted share of clients whose
        ‖Δ_i‖ exceeds each τ_j (:func:`norm_levels`); None without one.
    """

    stats: RoundStatistics
    clipped_share: float
    local_mean: Arrays = field(default_factory=dict)
    median_norm: float | None = None
    impossible: str | None = None
    norm_shares: tuple[float, ...] | None = None


def decode_sums(
    reference: Arrays,
    aggregate: Sequence[NDArray[Any]],
    adaptive: Sequence[str],
    num_clients: int,
    error_bound: float,
    *,
    norm_bound: float = 0.0,
    clipping_range: float = 1.0,
    local: Mapping[str, float] | None = None,
    rotated: Sequence[int] = (),
    rotation_seed: int = 0,
    coordinate_bound: float = 0.0,
    histogram: bool = False,
    tolerate_impossible: bool = False,
) -> tuple[DecodedSums | None, str | None]:
    """Split SecAgg+'s mean [Δ̄…, norm entry, clip flag] into sums, or say why not.

    ``reference`` is x_t (its keys name Δ̄'s arrays, in order);
    ``norm_bound`` and ``clipping_range`` are the round's B and c (the norm
    entry is decoded by :func:`decode_in_range`). ``rotated``: the indices
    of the arrays the clients sent as one rotated block (first, in place of
    those arrays; :func:`encode_update`), with the round's
    ``rotation_seed`` and κ = ``coordinate_bound``; ``histogram``: the
    norm histogram follows the clip flag. Checks what an honest
    round must satisfy, up to the quantisation errors: e per revealed
    coordinate (e·s/c per rotated one, s = :func:`coordinate_scale`), so
    ‖error of Δ̄‖ ≤ ε = e·√d unrotated, e·(s/c)·√D rotated; e_A =
    e·B²/(2c) of A (e without a bound): A ≥ −e_A, and A ≥ ‖Δ̄‖² − tol
    over the ``adaptive`` keys (Jensen: Σω‖Δ_i‖² ≥ ‖ΣωΔ_i‖² for convex
    ω), with tol = e_A + 2ε‖Δ̄‖ + ε² bounding what the errors can do to
    both sides. Under a bound A ≤ B² by construction, so Jensen's check
    also caps ‖Δ̄‖ at B: a client whose update exceeds the bound while its
    norm entry stays in range fails the round once it pushes Δ̄ past what
    A allows.

    ``tolerate_impossible``: sums that fail the checks on A are returned
    all the same, with A raised to ‖Δ̄‖² (the least A honest clients could
    have given: FedExP's and FedDuA's step then does not extrapolate) and
    why in ``impossible``; otherwise they are refused. The legacy strategy
    tolerates them in the calibration round, which does not step and needs
    only the norm histogram (one client's shares move by at most its
    weight), and in rounds whose replies the rotated block bounds by κ·B
    each, where no reply can carry more into Δ̄ than in any other round.
    Refusing them let one client stop rounds it cannot otherwise harm,
    the server unable to tell who: round 1 has no bound, so an update larger
    than its norm entry could say failed it again and again (the attack
    suite's ``anchor-inflate`` stalled FedExP and FedDuA), and in later
    rounds a zero norm claim beside a full update (``stall``) did the same
    where the honest clients agree (issue #38).
    """
    keys = list(reference)
    local = dict(local or {})
    in_block = [keys[j] for j in rotated]
    plain = [k for k in keys if k not in set(in_block)]
    model_arrays = (1 if in_block else 0) + len(plain)
    extra = EXTRA_ARRAYS + (1 if histogram else 0)
    expected = model_arrays + extra + len(local)
    if len(aggregate) != expected:
        return None, (
            f"the aggregate has {len(aggregate)} arrays, expected "
            f"{model_arrays} model arrays"
            + (f" ({len(in_block)} of them rotated as one)" if in_block else "")
            + f" + {extra} (norm entry, clip flag"
            + (", norm histogram)" if histogram else ")")
            + (f" + {len(local)} local-update arrays" if local else "")
        )
    mean: Arrays = {}
    e = error_bound
    error_sq = 0.0  # ε²: the squared L2 bound on Δ̄'s error over `adaptive`
    if in_block:
        size = sum(reference[k].size for k in in_block)
        block = np.asarray(aggregate[0], np.float64).reshape(-1)
        if block.size != rotated_size(size):
            return None, (
                f"the rotated block has {block.size} coordinates, "
                f"expected {rotated_size(size)}"
            )
        scale = coordinate_scale(norm_bound, coordinate_bound, size)
        flat = unrotate(block * scale / clipping_range, rotation_seed, size)
        offset = 0
        for k in in_block:
            x = reference[k]
            mean[k] = flat[offset : offset + x.size].reshape(x.shape)
            offset += x.size
        if set(in_block) & set(adaptive):
            error_sq += (e * scale / clipping_range) ** 2 * block.size
    for k, a in zip(
        plain, aggregate[model_arrays - len(plain) : model_arrays], strict=True
    ):
        if np.shape(a) != np.shape(reference[k]):
            return None, (
                f"aggregate array {k!r} has shape {np.shape(a)}, "
                f"not {reference[k].shape}"
            )
        mean[k] = np.asarray(a)
        if k in adaptive:
            error_sq += e * e * reference[k].size
    mean = {
        k: np.asarray(mean[k], dtype=np.result_type(reference[k].dtype, np.float32))
        for k in keys
    }
    entry = float(np.asarray(aggregate[model_arrays]).reshape(-1)[0])
    a_t = float(decode_in_range(entry, norm_bound**2, clipping_range))
    share = (
        float(np.asarray(aggregate[model_arrays + 1]).reshape(-1)[0]) / clipping_range
    )
    mean_sq = sq_norm({k: mean[k] for k in adaptive})
    e_a = e * norm_bound**2 / (2 * clipping_range) if norm_bound > 0 else e
    error = math.sqrt(error_sq)
    if not math.isfinite(mean_sq):  # no honest sum is: never tolerated
        return None, f"the sums are not finite: ‖Δ̄‖² = {mean_sq}"
    tol = e_a + 2 * error * math.sqrt(mean_sq) + error_sq
    impossible = None
    if not math.isfinite(a_t) or a_t < -e_a or a_t < mean_sq - tol:
        impossible = (
            f"impossible sums: A = {a_t:.6g} but ‖Δ̄‖² = {mean_sq:.6g} "
            f"(honest clients give A ≥ ‖Δ̄‖² − {tol:.3g}, Jensen): a client's "
            "norm does not match its update"
            + (
                f", or its update exceeds the round's bound {norm_bound:.6g}"
                if norm_bound > 0
                else ""
            )
        )
        if not tolerate_impossible:
            return None, impossible
        a_t = max(a_t, mean_sq) if math.isfinite(a_t) else mean_sq
    stats = RoundStatistics(mean, max(a_t, 0.0), num_clients)
    median = None
    norm_shares = None
    if histogram:
        shares = decode_in_range(
            np.asarray(aggregate[model_arrays + EXTRA_ARRAYS], np.float64).reshape(-1),
            1.0,
            clipping_range,
        )
        if shares.size != NORM_LEVELS:
            return None, (
                f"the norm histogram has {shares.size} levels, expected {NORM_LEVELS}"
            )
        median = median_from_histogram(list(shares))
        norm_shares = tuple(float(v) for v in shares)
    first = model_arrays + extra
    local_mean = {
        name: np.asarray(decode_in_range(aggregate[first + j], top, clipping_range))
        for j, (name, top) in enumerate(local.items())
    }
    clipped = min(max(share, 0.0), 1.0)
    decoded = DecodedSums(stats, clipped, local_mean, median, impossible, norm_shares)
    return decoded, None


def step_statistics(
    decoded: DecodedSums,
    *,
    needs_sq_norms: bool,
    adaptive: Sequence[str],
    weights: Sequence[float],
    norm_bound: float,
    coordinate_bound: float,
    step_guard: bool,
) -> RoundStatistics:
    """Return the statistics a rule steps on from one decoded SecAgg+ round.

    What the legacy strategy and the attack suite do alike: a rule that
    needs no A (FedAvg, FedAdam, …) gets none; under ``step_guard``
    (:attr:`SecAggPlusSettings.step_guard`) the leave-one-out worst case of
    :func:`guard_on_sums` (``weights``: the clients' r_i; ``norm_bound`` 0
    where nothing bounds a reply, the unrotated rounds).
    """
    stats = decoded.stats
    if not needs_sq_norms:
        return RoundStatistics(stats.mean_update, None, stats.num_clients)
    if step_guard:
        stats = guard_on_sums(stats, adaptive, weights, norm_bound, coordinate_bound)
    return stats


def guard_on_sums(
    stats: RoundStatistics,
    adaptive: Sequence[str],
    weights: Sequence[float],
    norm_bound: float,
    coordinate_bound: float,
) -> RoundStatistics:
    """Return ``stats`` with the step guard's worst case of one client removed.

    The step guard (:meth:`~fedadapt.strategies.feddua.FedDuARule.
    guard_step_size`) caps η_t at the step the round would give without
    any one client; under SecAgg+ no client's update is known, only what
    one client can at most have put into the sums. With ω the largest
    weight share (``weights``: the clients' r_i), L = κ·B the most one
    reply can carry in L2 (the rotated block, :func:`rotate`) and B² the
    most its norm entry can claim, leaving it out gives at worst

        Δ̄_{−i} = Δ̄·(1 + ω·L/‖Δ̄‖)/(1 − ω),   A_{−i} = max(0, A − ω·B²)/(1 − ω)

    (‖Δ̄_{−i}‖ ≤ (‖Δ̄‖ + ω‖Δ_i‖)/(1 − ω) along Δ̄, A_{−i} =
    (A − ω‖Δ_i‖²)/(1 − ω)): a lower bound of every η^{(−i)} for FedExP,
    whose step falls with ‖Δ̄_{−i}‖ and rises with A_{−i}, and for FedDuA
    along Δ̄'s own direction. The guarded rules then step no further than
    the most damped of these, so no client, whatever it sent within the
    bounds, raises the extrapolation. Without a bound or a rotation
    (round 1 unless ``max-update-norm`` is set) nothing limits a reply:
    A_{−i} = 0, and the rules take their smallest step (FedExP: η = 1, a
    FedAvg step).
    """
    total = float(sum(weights))
    share = max(weights) / total if total > 0 and weights else 1.0
    reach = coordinate_bound * norm_bound
    a = stats.mean_sq_norm
    mean = {k: np.asarray(stats.mean_update[k], np.float64) for k in adaptive}
    length = math.sqrt(sq_norm(mean))
    bounded = reach > 0 and share < 1 and a is not None and length > 0

    def generate() -> Iterator[tuple[Arrays, float | None]]:
        if not bounded:
            yield mean, 0.0
            return
        assert a is not None
        grow = (1 + share * reach / length) / (1 - share)
        yield (
            {k: v * grow for k, v in mean.items()},
            max(0.0, a - share * norm_bound**2) / (1 - share),
        )

    without_each: Callable[[], Iterator[tuple[Arrays, float | None]]] = generate
    return dataclasses.replace(stats, without_each=without_each)
