"""Reject on negative influence: the server's validation set judges each reply.

No bound on an update's size, weight or direction separates a hostile
client from an honest one on non-IID data: a client that sends its own
update reversed, at its own norm and true weight, looks like an honest
client with unusual data (docs/robustness.md, the quiet attacks, which
cost FedAvg 8 points on Dirichlet-0.5 digits under every such bound). What
separates them is what the update *does*. RONI, "reject on negative
influence" (Nelson et al., "Exploiting machine learning to subvert your
spam filter", 2008; Barreno et al., "The security of machine learning",
2010), measures that on data the server holds: a client whose presence in
the round's aggregate makes the model worse on the server's validation set
is left out of it.

With Δ̄ = Σ_j ω_j s_j Δ_j the round's (clipped, weighted) mean update,
Δ̄ − ω_i s_i Δ_i = (1 − ω_i)·Δ̄_{−i} the same with client i's part taken
out (not renormalised; Δ̄_{−i} from :func:`~fedadapt.strategies.core.
aggregation.leave_one_out`), and L the validation loss,

    influence_i = (L(x + Δ̄) − L(x + Δ̄ − ω_i s_i Δ_i)) / |L(x + Δ̄ − ω_i s_i Δ_i)|,

positive when client i's part raises the loss: by what fraction of the
loss the round would have had without that part. A client whose influence
exceeds ``tolerance`` is rejected, at most ⌊(n − 1)/2⌋ of a round's n
(:func:`influence_limit`): the defence singles out a minority and never
empties a round.

Our choices (none of the papers is federated):

- The client's part is taken out, not replaced by the others' mean
  (renormalised, x + Δ̄_{−i}). With the renormalised mean, an honest client
  whose step is merely shorter than the others' looks harmful whenever
  the mean step is short of the validation optimum (FedAvg's usually is:
  that is why FedExP extrapolates), and on digits-mlp's honest runs 1–2.4
  honest replies a round were rejected (13–48 of 200; honest accuracy
  −0.5 to −1.1 for FedAvg, FedAvgM, FedDuA-Adagrad). Taking the part out
  asks only whether it moves the model the wrong way; with the two
  choices below, the same honest runs lose at most 0.44 points (5 seeds,
  every strategy; docs/robustness.md). What that costs
  against an attacker: its reply may do what leaving its weight empty
  would (a client that sends nothing has influence 0), plus the
  tolerance.
- One at a time: the most harmful client is rejected, then every
  influence is measured again without it (:func:`~fedadapt.strategies.
  adapter.apply_rule` does this), until none exceeds the tolerance. Each
  influence is measured against an aggregate that holds every other
  reply, so a single pass lets one reply make others look harmful:
  hostile clients that send a multiple of honest client j's update make
  the aggregate overshoot along Δ_j, and j's part then seems to raise
  the loss (the suite's ``frame`` attack). Once the most harmful reply is
  out, the others are judged without it. A round without a rejection
  costs one pass, each rejection one more.
- Together as well as alone: when no client is over the tolerance alone,
  the parts of every client whose influence is positive are taken out
  together, and if that raises the loss by more than the tolerance the
  most harmful of them is rejected (and all measured again). Colluders
  that each stay under the tolerance with the others present add up: two
  or three such clients cost FedAvg 10–19 points on digits-mlp at 1 %
  when each was judged alone. For a quadratic loss with positive
  semi-definite curvature the group's rise in loss is at most the sum of
  its members' (each member's is measured with the others' parts in the
  aggregate), so clients whose own rises are all ≤ 0 cannot raise it
  together: the group of the positive ones is the one to test. One more
  validation pass a round, only when two or more clients are positive.
- One at a time and the one group, not a search over subsets.
- The candidate models step with η = 1 on Δ̄, whatever the rule: the
  question is what the clients' data does, not what the server's
  optimiser would make of it (FedAdam's normalised step would judge the
  same updates differently round by round).
- The tolerance is relative to the validation loss, so one
  setting serves a cross-entropy near 2 and a squared error near 0.1
  (:data:`DEFAULT_INFLUENCE_TOLERANCE`).

Plain NumPy; the validation loss is the caller's function of a model's
arrays (the app builds it from the task's model and a sample of its
training pool; a Flower user passes their own).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

Arrays = dict[str, NDArray[Any]]

#: The validation loss of a model given as its arrays (the global model's
#: names, dtypes and shapes).
ValidationLoss = Callable[[Mapping[str, NDArray[Any]]], float]

#: Default relative tolerance: a reply is rejected when its presence raises
#: the validation loss of the round's aggregate by more than 0.5 %. On
#: digits-mlp (docs/robustness.md) 1 % left an attacker that knows the
#: screen 4.7 points against FedAvg (1 % a round adds up); at 0.5 % the
#: worst attack cost every strategy at most 1.9, honest runs −1.1 to +0.3.
DEFAULT_INFLUENCE_TOLERANCE = 0.005


@dataclass(frozen=True)
class Influence:
    """What the screen measured in one round.

    Attributes
    ----------
    loss : float
        L(x + Δ̄), the validation loss of the aggregate with every client
        (+inf when it is not finite).
    influence : tuple[float, ...]
        Each client's influence (see the module docstring), in the order of
        the replies.
    rejected : tuple[int, ...]
        Indices of the replies to leave out, most harmful first.
    group_influence : float | None
        The influence of the clients whose own influence is positive, taken
        out together (None: fewer than two of them, or one is rejected on
        its own).
    """

    loss: float
    influence: tuple[float, ...]
    rejected: tuple[int, ...]
    group_influence: float | None = None


def candidate(
    reference: Mapping[str, NDArray[Any]], update: Mapping[str, NDArray[Any]]
) -> Arrays:
    """Return the model x + Δ: ``update``'s float arrays added, in x's dtypes.

    Arrays ``update`` lacks, and integer arrays (BatchNorm's batch counter),
    stay as in ``reference``.
    """
    out = {}
    for key, value in reference.items():
        step = update.get(key)
        if step is None or value.dtype.kind != "f":
            out[key] = value
        else:
            out[key] = (value + step).astype(value.dtype, copy=False)
    return out


def negative_influence(
    reference: Mapping[str, NDArray[Any]],
    mean_update: Mapping[str, NDArray[Any]],
    without_each: Callable[[], Iterator[tuple[Mapping[str, NDArray[Any]], Any]]],
    weights: Sequence[float],
    validation_loss: ValidationLoss,
    tolerance: float = DEFAULT_INFLUENCE_TOLERANCE,
) -> Influence:
    """Measure each client's influence on the validation loss; pick rejections.

    ``without_each`` yields Δ̄_{−i} client by client (over the arrays it
    covers; the others keep Δ̄'s value), as
    :func:`~fedadapt.strategies.core.aggregation.leave_one_out` does, and
    ``weights`` are the ω_i: client i's part is taken out as
    (1 − ω_i)·Δ̄_{−i} (see the module docstring).
    A loss that is not finite counts as infinite: a client without which
    the aggregate's loss becomes finite has influence +inf (an update that
    breaks the validation loss is rejected, not a way to switch the screen
    off), one without which it stays non-finite 0 (nothing to compare).
    Raises ``ValueError`` for a negative or non-finite ``tolerance``.
    """
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance}")
    loss = _finite_or_inf(validation_loss(candidate(reference, mean_update)))
    influence: list[float] = []
    # (1 − ω_i)·Δ̄_{−i}; leave_one_out skips a client that holds all weight
    shares = [1.0 - w for w in weights if 1.0 - w > 0]
    harmful_parts: Arrays | None = None  # Σ ω_i s_i Δ_i over influence_i > 0
    for share, (renormalised, _) in zip(shares, without_each(), strict=True):
        part_out = {k: v * share for k, v in renormalised.items()}
        without = _finite_or_inf(
            validation_loss(candidate(reference, {**mean_update, **part_out}))
        )
        influence.append(_relative_rise(loss, without))
        if 0 < influence[-1] < math.inf:  # its part: Δ̄ − part_out
            if harmful_parts is None:
                harmful_parts = {k: np.zeros_like(v) for k, v in part_out.items()}
            for k, v in part_out.items():
                harmful_parts[k] += mean_update[k] - v
    limit = influence_limit(len(influence))
    harmful = sorted(
        (i for i, value in enumerate(influence) if value > tolerance),
        key=lambda i: -influence[i],
    )
    positive = sorted(
        (i for i, value in enumerate(influence) if 0 < value < math.inf),
        key=lambda i: -influence[i],
    )
    if harmful or len(positive) < 2 or harmful_parts is None:
        return Influence(loss, tuple(influence), tuple(harmful[:limit]))
    group_out = {k: mean_update[k] - v for k, v in harmful_parts.items()}
    group = _relative_rise(
        loss,
        _finite_or_inf(
            validation_loss(candidate(reference, {**mean_update, **group_out}))
        ),
    )
    rejected = (positive[0],) if group > tolerance and limit > 0 else ()
    return Influence(loss, tuple(influence), rejected, group)


def _relative_rise(loss: float, without: float) -> float:
    """(loss − without)/|without|, with the conventions for non-finite losses.

    A loss that is worse without the part (negative) means the part helped;
    +inf when only the part breaks the loss; −inf when the model breaks
    without it; 0 when it is broken either way (nothing to compare).
    """
    if math.isinf(without):
        return 0.0 if math.isinf(loss) else -math.inf
    if math.isinf(loss):
        return math.inf
    return (loss - without) / max(abs(without), np.finfo(np.float64).tiny)


def influence_limit(num_replies: int) -> int:
    """Return ⌊(n − 1)/2⌋: the most replies of n the screen rejects in a round."""
    return max(0, (num_replies - 1) // 2)


def _finite_or_inf(value: float) -> float:
    """Return ``value`` as a float, +inf where it is not finite (NaN too)."""
    value = float(value)
    return value if math.isfinite(value) else math.inf
