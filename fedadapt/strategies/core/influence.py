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

With Δ̄ the round's (clipped, weighted) mean update and Δ̄_{−i} the same
without client i (:func:`~fedadapt.strategies.core.aggregation.
leave_one_out`), and L the validation loss,

    influence_i = (L(x + Δ̄) − L(x + Δ̄_{−i})) / |L(x + Δ̄_{−i})|,

positive when client i raises the loss: by what fraction of the loss the
round would have had without it. A client whose influence exceeds
``tolerance`` is rejected, at most ⌊(n − 1)/2⌋ of a round's n
(:func:`influence_limit`): the defence singles out a minority and never
empties a round.

Our choices (none of the papers is federated):

- The candidate models step with η = 1 on Δ̄, whatever the rule: the
  question is what the clients' data does, not what the server's
  optimiser would make of it (FedAdam's normalised step would judge the
  same updates differently round by round).
- The tolerance is relative to the validation loss, so one
  setting serves a cross-entropy near 2 and a squared error near 0.1
  (:data:`DEFAULT_INFLUENCE_TOLERANCE`).
- One at a time: the most harmful client is rejected, then every
  influence is measured again without it
  (:func:`~fedadapt.strategies.adapter.apply_rule` does this), until none
  exceeds the tolerance. Each influence is measured against an aggregate
  that holds every other reply, so a single pass lets one reply make
  others look harmful: a hostile client that sends a multiple of an
  honest update makes the aggregate step further (or overshoot), and the
  clients with shorter steps then seem to hold it back (the suite's
  ``frame`` attack; tests/strategies/test_influence.py has a small case
  where one pass rejects two honest clients and this rejects one). Once
  the most harmful reply is out, the others are judged without it. On
  digits-mlp's honest runs (5 seeds) it rejected about as many honest
  replies as one pass (15–49 of 200 against 13–48), yet the worst honest
  cost went from −1.1 points (FedAvgM, one pass) to −0.6 (FedAvg,
  FedAvgM). A round without a rejection costs one pass, each rejection
  one more.
- Renormalised: client i is replaced by the others' mean, so a client
  that sends nothing (or a short step) is measured by the progress it
  dilutes. Tried instead (docs/robustness.md): taking client i's part
  out without renormalising, x + Δ̄ − ω_i Δ_i, with the clients of
  positive influence also taken out together (against colluders).
  Honest runs then lost at most 0.44 points, but an attacker gets its
  dilution for free on top of the tolerance: one hostile client of ten
  cost FedAvg up to 7.1 points (1.3 with this measure, one pass). The
  test of the positive clients together, with this measure, rejected so
  many honest replies that honest FedAvg lost 1.1 points.
- Not a search over subsets: with colluding clients that send the same
  update each one's absence leaves the other's in the mean, which is what
  the suite's two- and three-client rows measure.

Plain NumPy; the validation loss is the caller's function of a model's
arrays (the app builds it from the task's model and a sample of its
training pool; a Flower user passes their own).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
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
    """

    loss: float
    influence: tuple[float, ...]
    rejected: tuple[int, ...]


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
    validation_loss: ValidationLoss,
    tolerance: float = DEFAULT_INFLUENCE_TOLERANCE,
) -> Influence:
    """Measure each client's influence on the validation loss; pick rejections.

    ``without_each`` yields Δ̄_{−i} client by client (over the arrays it
    covers; the others keep Δ̄'s value), as
    :func:`~fedadapt.strategies.core.aggregation.leave_one_out` does.
    A loss that is not finite counts as infinite: a client without which
    the aggregate's loss becomes finite has influence +inf (an update that
    breaks the validation loss is rejected, not a way to switch the screen
    off), one without which it stays non-finite 0 (nothing to compare).
    Raises ``ValueError`` for a negative or non-finite ``tolerance``.
    """
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance}")
    loss = _finite_or_inf(validation_loss(candidate(reference, mean_update)))
    tiny = np.finfo(np.float64).tiny
    influence = []
    for partial, _ in without_each():
        model = candidate(reference, {**mean_update, **partial})
        without = _finite_or_inf(validation_loss(model))
        if math.isinf(without):  # worse without it: it keeps the model sane
            influence.append(0.0 if math.isinf(loss) else -math.inf)
        elif math.isinf(loss):  # the aggregate breaks only with it
            influence.append(math.inf)
        else:  # worse without the client (negative): the client helped
            influence.append((loss - without) / max(abs(without), tiny))
    harmful = sorted(
        (i for i, value in enumerate(influence) if value > tolerance),
        key=lambda i: -influence[i],
    )
    limit = influence_limit(len(influence))
    return Influence(loss, tuple(influence), tuple(harmful[:limit]))


def influence_limit(num_replies: int) -> int:
    """Return ⌊(n − 1)/2⌋: the most replies of n the screen rejects in a round."""
    return max(0, (num_replies - 1) // 2)


def _finite_or_inf(value: float) -> float:
    """Return ``value`` as a float, +inf where it is not finite (NaN too)."""
    value = float(value)
    return value if math.isfinite(value) else math.inf
