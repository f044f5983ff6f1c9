"""One hyperparameter check shared by strategies and optimizers (torch style)."""

from __future__ import annotations

import math


def check_scalar(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """Return ``value`` as float or raise ``ValueError(f"Invalid {name}: {value}")``.

    ``value`` must be a finite real number within the given bounds.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"Invalid {name}: {value!r} (expected a number)")
    value = float(value)
    ok = math.isfinite(value)
    if ok and low is not None:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value <= high if high_inclusive else value < high
    if not ok:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = ("[" if low_inclusive else "(") + f"{lo}, {hi}"
        interval += "]" if high_inclusive else ")"
        raise ValueError(f"Invalid {name}: {value} (must be in {interval})")
    return value


def check_decay_rate(name: str, value: float) -> float:
    """Return a decay rate (β1, β2, momentum) as float; it must lie in [0, 1).

    One place for the bound every moment and momentum coefficient shares:
    β = 1 would freeze the average at its start value.
    """
    return check_scalar(name, value, low=0.0, high=1.0, high_inclusive=False)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ValueError."""
    if value not in choices:
        raise ValueError(
            f"Invalid {name}: {value!r} (valid: {', '.join(map(repr, choices))})"
        )
    return value
