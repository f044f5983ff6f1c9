"""One hyperparameter, declared once: :class:`Param`.

Algorithms (:mod:`fedadapt.strategies.declaration`) and the server halves of
local updates (:mod:`fedadapt.strategies.local_update`) declare their
hyperparameters with it; their classes, run-config keys
``<name>.<param>`` and docs tables are derived from the declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedadapt._validation import check_choice, check_scalar

Scalar = bool | int | float | str

__all__ = ["Paper", "Param", "Scalar"]


@dataclass(frozen=True)
class Param:
    """One hyperparameter of an algorithm.

    Attributes
    ----------
    name : str
        The Python keyword (Flower's name where the class is a drop-in).
    default : bool | int | float | str
        The default; its type is the parameter's type.
    doc : str
        One line: what it is (no default, no source).
    source : str
        Where the default comes from: a paper section or "Flower's FedAdam".
    low, high : float | None
        Bounds of a number (None: unbounded).
    low_open, high_open : bool
        Whether the bound itself is excluded.
    choices : tuple[str, ...] | None
        The accepted values of a string.
    legacy_default : bool | int | float | str | None
        The legacy class's default where Flower's legacy class differs
        (τ of legacy FedAdam / FedAdagrad); None: ``default``.
    """

    name: str
    default: Scalar
    doc: str
    source: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    legacy_default: Scalar | None = None

    def check(self, value: Any) -> Scalar:
        """Return ``value`` of this parameter's type, or raise ValueError naming it."""
        kind = type(self.default)
        if kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"Invalid {self.name}: {value!r} (expected a bool)")
            return value
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(f"Invalid {self.name}: {value!r} (expected a string)")
            if self.choices is None:
                return value
            return check_choice(self.name, value, self.choices)
        number = check_scalar(
            self.name,
            value,
            low=self.low,
            high=self.high,
            low_inclusive=not self.low_open,
            high_inclusive=not self.high_open,
        )
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Invalid {self.name}: {value!r} (expected an int)")
            return value
        return number

    def python_default(self, legacy: bool = False) -> Scalar:
        """Return the default of the Message-API (or legacy) class."""
        if legacy and self.legacy_default is not None:
            return self.legacy_default
        return self.default

    def describe(self) -> str:
        """Return the doc line with its bounds or choices and the default's source."""
        parts = (self.doc, self.domain(), f"Default: {self.source}.")
        return " ".join(part for part in parts if part)

    def domain(self) -> str:
        """Return the accepted values in words, e.g. ``In [0, 1).``."""
        if self.choices:
            return "One of " + ", ".join(f"``{c!r}``" for c in self.choices) + "."
        if isinstance(self.default, bool) or isinstance(self.default, str):
            return ""
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            right = ")" if self.high_open else "]"
            return f"In {left}{self.low:g}, {self.high:g}{right}."
        if self.low is not None:
            return f"{'>' if self.low_open else '≥'} {self.low:g}."
        return ""


@dataclass(frozen=True)
class Paper:
    """Where an algorithm comes from, as the generated docs tables cite it.

    Attributes
    ----------
    short : str
        Authors and year for README's strategies table (``Acar et al. 2021``).
    full : str
        Authors, *title*, venue and the algorithm box followed, for the
        papers table of docs/algorithms.md (Markdown).
    """

    short: str
    full: str
