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
(:data:`~fedadapt.strategies.wire.SECAGG_NORM_BOUND`; the legacy strategy
sets B_{t+1} = k·√A_t, k = ``max_update_norm_ratio``, at most
``max_update_norm``). An honest client clips its update to B_t before
masking, Δ_i ← Δ_i·min(1, B_t/‖Δ_i‖), and sends its norm as the
coordinate c·(2‖Δ_i‖²/B_t² − 1) of [−c, c] (:func:`encode_in_range`),
whose mean decodes to A (:func:`decode_in_range`). Flower's mod clips every
coordinate to ±c, so a client that lies about its norm moves A by at most
ω_i·B_t² (its entry cannot leave [0, B_t²]); and since Jensen's check
(A ≥ ‖Δ̄‖²) must still hold, a client that sends a large Δ_i with a small
norm fails the round instead of moving the model by more than B_t. The clip
flag (c when the client clipped, else 0) tells the server the weighted share
of clients the bound clipped, and nothing per client. Round 1 has no A yet:
its bound is ``max_update_norm`` (0: none, the norm then travels as is).

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

import json
import math
from collections.abc import Mapping, Sequence
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
    """

    clipping_range: float = 8.0
    quantization_range: int = 1 << 22
    modulus_range: int = 1 << 32
    max_weight: float = 1.0
    num_shares: float = 1.0
    reconstruction_threshold: float = 0.5

    def __post_init__(self) -> None:
        """Check the ranges as Flower's workflow would, and more strictly."""
        check_scalar("clipping_range", self.clipping_range, low=0, low_inclusive=False)
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
        self, uniform: bool, norm_bound: float = 0.0
    ) -> dict[str, float | int]:
        """Return what a client needs to encode and check its update.

        ``norm_bound``: B_t, the L2 norm each client clips its update to
        (0: none this round).
        """
        return {
            wire.SECAGG_CLIPPING_RANGE: self.clipping_range,
            wire.SECAGG_QUANTIZATION_RANGE: self.quantization_range,
            wire.SECAGG_MAX_WEIGHT: self.max_weight,
            wire.SECAGG_UNIFORM: int(uniform),
            wire.SECAGG_NORM_BOUND: float(norm_bound),
        }

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
        )


#: Arrays after Δ_i's in a client's masked reply: its norm entry, its clip flag
EXTRA_ARRAYS = 2


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
    else 0. The weight is 1 under uniform weighting, else ``num_examples``.
    The count is the number of coordinates of r·arrays beyond ±c (plus one
    when the weight exceeds ``max_weight``): the client's own check before
    masking, since Flower clips silently.
    """
    settings = SecAggPlusSettings.from_fit_config(config)
    if settings is None:
        raise ValueError("not a SecAgg+ fit config")
    weight = 1 if int(config[wire.SECAGG_UNIFORM]) else int(num_examples)
    c = settings.clipping_range
    bound = float(config.get(wire.SECAGG_NORM_BOUND, 0.0))
    arrays = [
        np.subtract(x, s, dtype=np.float64) for s, x in zip(sent, trained, strict=True)
    ]
    if trainable is None:
        trainable = [np.asarray(x).dtype.kind == "f" for x in sent]
    clipped_to_bound = bound > 0 and update_sq_norm > bound**2
    if clipped_to_bound:
        scale = bound / math.sqrt(update_sq_norm)
        arrays = [
            a * scale if counted else a
            for a, counted in zip(arrays, trainable, strict=True)
        ]
        update_sq_norm = bound**2  # exactly: its entry is c, never beyond
    entry = encode_in_range(update_sq_norm, bound**2, c)
    arrays.append(np.array([entry], np.float64))
    arrays.append(np.array([c if clipped_to_bound else 0.0], np.float64))
    ranges = local_ranges(config)
    for name, values in (local or {}).items():
        top = ranges.get(name, 0.0)
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


def aggregate_problem(
    settings: SecAggPlusSettings, clipped: Mapping[str, Any]
) -> str | None:
    """Why a round's SecAgg+ aggregate cannot be used, or None.

    ``clipped`` maps each client (node) to its reported
    :data:`~fedadapt.strategies.wire.SECAGG_CLIPPED` (None: missing).
    """
    n = len(clipped)
    if n > settings.max_clients:
        return (
            f"{n} clients but the masked sum is exact only for n·Q < M "
            f"(at most {settings.max_clients}): raise secagg-modulus-range or "
            "lower secagg-quantization-range"
        )
    missing = sorted(str(k) for k, v in clipped.items() if v is None)
    if missing:
        return (
            f"nodes {', '.join(missing)} sent no {wire.SECAGG_CLIPPED}: not "
            "fedadapt clients in secagg+ mode, the aggregate cannot be checked"
        )
    over = {k: int(v) for k, v in clipped.items() if v is not None and int(v) > 0}
    if over:
        listed = ", ".join(f"node {k}: {v}" for k, v in sorted(over.items()))
        return (
            f"coordinates beyond ±{settings.clipping_range:g} after scaling "
            f"({listed}); SecAgg+ would clip them and the sum would be wrong: "
            "raise secagg-clipping-range (or secagg-max-weight, if a weight "
            "exceeded it)"
        )
    return None


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
    """

    stats: RoundStatistics
    clipped_share: float
    local_mean: Arrays = field(default_factory=dict)


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
) -> tuple[DecodedSums | None, str | None]:
    """Split SecAgg+'s mean [Δ̄…, norm entry, clip flag] into sums, or say why not.

    ``reference`` is x_t (its keys name Δ̄'s arrays, in order);
    ``norm_bound`` and ``clipping_range`` are the round's B and c (the norm
    entry is decoded by :func:`decode_in_range`). Checks what an honest
    round must satisfy, up to the quantisation errors: e per coordinate of
    Δ̄, e_A = e·B²/(2c) of A (e without a bound): A ≥ −e_A, and
    A ≥ ‖Δ̄‖² − tol over the ``adaptive`` keys (Jensen: Σω‖Δ_i‖² ≥
    ‖ΣωΔ_i‖² for convex ω), with tol = e_A + 2e·√d·‖Δ̄‖ + d·e² (d adaptive
    coordinates) bounding what the errors can do to both sides. Under a
    bound A ≤ B² by construction, so Jensen's check also caps ‖Δ̄‖ at B: a
    client whose update exceeds the bound while its norm entry stays in
    range fails the round once it pushes Δ̄ past what A allows.
    """
    keys = list(reference)
    local = dict(local or {})
    expected = len(keys) + EXTRA_ARRAYS + len(local)
    if len(aggregate) != expected:
        return None, (
            f"the aggregate has {len(aggregate)} arrays, expected "
            f"{len(keys)} model arrays + {EXTRA_ARRAYS} (norm entry, clip flag)"
            + (f" + {len(local)} local-update arrays" if local else "")
        )
    mean: Arrays = {}
    for k, a in zip(keys, aggregate, strict=False):
        x = reference[k]
        if np.shape(a) != np.shape(x):
            return None, f"aggregate array {k!r} has shape {np.shape(a)}, not {x.shape}"
        mean[k] = np.asarray(a, dtype=np.result_type(x.dtype, np.float32))
    entry = float(np.asarray(aggregate[len(keys)]).reshape(-1)[0])
    a_t = float(decode_in_range(entry, norm_bound**2, clipping_range))
    share = float(np.asarray(aggregate[len(keys) + 1]).reshape(-1)[0]) / clipping_range
    mean_sq = sq_norm({k: mean[k] for k in adaptive})
    d = sum(mean[k].size for k in adaptive)
    e = error_bound
    e_a = e * norm_bound**2 / (2 * clipping_range) if norm_bound > 0 else e
    tol = e_a + 2 * e * math.sqrt(d * mean_sq) + d * e * e
    if not math.isfinite(a_t) or a_t < -e_a or a_t < mean_sq - tol:
        return None, (
            f"impossible sums: A = {a_t:.6g} but ‖Δ̄‖² = {mean_sq:.6g} "
            f"(honest clients give A ≥ ‖Δ̄‖² − {tol:.3g}, Jensen): a client's "
            "norm does not match its update"
            + (
                f", or its update exceeds the round's bound {norm_bound:.6g}"
                if norm_bound > 0
                else ""
            )
        )
    stats = RoundStatistics(mean, max(a_t, 0.0), num_clients)
    first = len(keys) + EXTRA_ARRAYS
    local_mean = {
        name: np.asarray(decode_in_range(aggregate[first + j], top, clipping_range))
        for j, (name, top) in enumerate(local.items())
    }
    return DecodedSums(stats, min(max(share, 0.0), 1.0), local_mean), None
