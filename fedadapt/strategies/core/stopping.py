"""When to end a run early: a target value reached, or no improvement.

Flower's round loop always runs ``num_rounds`` rounds (Flower issue #4457;
its nightly adds a ``should_stop`` predicate to ``Strategy.start``).
:class:`StopRule` is the decision itself, framework-free: it watches one
metric, fed once per evaluation, and says why to stop. The two stopping
criteria are the usual ones (our choice; e.g. Keras' ``EarlyStopping``):
a target value, and ``patience`` evaluations in a row without an
improvement larger than ``min_delta`` over the best value so far.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fedadapt._validation import check_choice, check_scalar

STOP_MODES = ("max", "min")

#: ``StopRule.reason`` values: why a run ended before its last round.
STOP_TARGET = "stop-target"
STOP_PATIENCE = "stop-patience"


class StopRule:
    """Stop when ``metric`` reaches ``target`` or stops improving.

    Parameters
    ----------
    metric : str
        Name of the watched metric (e.g. ``"accuracy"``, ``"loss"``).
    mode : str (default: "max")
        ``"max"``: larger is better (accuracy); ``"min"``: smaller (loss).
    target : float | None (default: None)
        Stop once a value is at least (``max``) / at most (``min``) this.
    patience : int (default: 0)
        Stop after this many evaluations in a row without improvement;
        0 = never.
    min_delta : float (default: 0.0)
        An improvement must beat the best value by more than this.

    Attributes
    ----------
    best, best_round : float | None, int | None
        Best value seen and the round it was seen in.
    waited : int
        Evaluations since the best one.
    reason, message : str | None
        Once :meth:`update` said stop: :data:`STOP_TARGET` or
        :data:`STOP_PATIENCE`, and a sentence for logs.
    """

    def __init__(
        self,
        metric: str,
        *,
        mode: str = "max",
        target: float | None = None,
        patience: int = 0,
        min_delta: float = 0.0,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"Invalid stop metric: {metric!r} (a metric name)")
        self.metric = metric
        self.mode = check_choice("stop_mode", mode, STOP_MODES)
        self.target = None if target is None else check_scalar("stop_target", target)
        if check_scalar("stop_patience", patience, low=0) % 1:
            raise ValueError(f"Invalid stop_patience: {patience} (an int)")
        self.patience = int(patience)
        self.min_delta = check_scalar("stop_min_delta", min_delta, low=0)
        if self.target is None and self.patience == 0:
            raise ValueError(
                f"stop metric {metric!r} needs stop_target or stop_patience > 0"
            )
        self.best: float | None = None
        self.best_round: int | None = None
        self.waited = 0
        self.reason: str | None = None
        self.message: str | None = None

    def __repr__(self) -> str:
        """``StopRule('accuracy', mode='max', target=0.9, patience=0, ...)``."""
        return (
            f"StopRule({self.metric!r}, mode={self.mode!r}, target={self.target!r}, "
            f"patience={self.patience!r}, min_delta={self.min_delta!r})"
        )

    def _better(self, value: float, than: float) -> bool:
        if self.mode == "max":
            return value > than + self.min_delta
        return value < than - self.min_delta

    def update(self, server_round: int, value: float) -> str | None:
        """Feed the metric after ``server_round``; return why to stop, or None.

        A NaN value is never an improvement and never reaches the target.
        """
        value = float(value)
        if not math.isnan(value) and (
            self.best is None or self._better(value, self.best)
        ):
            self.best, self.best_round, self.waited = value, server_round, 0
        else:
            self.waited += 1
        if self.target is not None and (
            value >= self.target if self.mode == "max" else value <= self.target
        ):
            self.reason = STOP_TARGET
            self.message = (
                f"{self.metric} = {value:.6g} reached stop target {self.target:g} "
                f"in round {server_round}"
            )
        elif self.patience and self.waited >= self.patience:
            self.reason = STOP_PATIENCE
            self.message = (
                f"no improvement of {self.metric} for {self.waited} evaluations "
                f"(best {self.best} in round {self.best_round})"
            )
        else:
            return None
        return self.reason

    def state_dict(self) -> dict[str, Any]:
        """Return what a resumed run needs to continue the count."""
        return {
            "best": self.best,
            "best_round": self.best_round,
            "waited": self.waited,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        best, best_round = state["best"], state["best_round"]
        self.best = None if best is None else float(best)
        self.best_round = None if best_round is None else int(best_round)
        self.waited = int(state["waited"])


def find_metric(name: str, *sources: Mapping[str, Any] | None) -> float | None:
    """Return metric ``name`` from the first source that has it as a number."""
    for source in sources:
        if source is None:
            continue
        value = source.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None
