"""Reply screening and rule application shared by both Flower APIs.

Flower's stock strategies end the run when one reply is inconsistent and
average NaN straight into the global model. Every fedadapt strategy screens
train replies first: a reply whose arrays are non-finite or differ in names,
shape or dtype from what the server sent, or whose metrics lack a positive
finite weight (``num-examples``) or carry a negative or non-finite
``update-sq-norm``, is dropped with a warning and counted. Everything here is
plain NumPy over ``dict[str, ndarray]``; the Flower adapters only unpack
messages into that form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log
from numpy.typing import NDArray

from fedadapt.strategies.core import Arrays, ServerRule


class RuleHost:
    """What both Flower adapters share: the rule, reports, hooks and state.

    Attributes
    ----------
    rule : ServerRule
        The framework-free update rule (set by the concrete class).
    average_last_two : bool
        Evaluate (w_t + w_{t+1})/2 instead of w_{t+1}; training continues
        from w_{t+1} (FedExP/FedDuA, spec §5.3).
    round_reports : dict[int, dict]
        Per round: ``train_replies`` / ``evaluate_replies`` counts and
        rejection reasons, aggregated ``train`` / ``federated_eval`` metrics
        and the rule's ``diagnostics`` (server step size, norms).
    """

    rule: ServerRule

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.average_last_two = False
        self.round_reports: dict[int, dict[str, Any]] = {}

    def check_reply(self, candidate: Candidate) -> str | None:
        """Return why a (screened) train reply is unusable; override to extend."""
        return None

    def after_aggregate(self, valid: list[Candidate]) -> dict[str, float | None]:
        """Update extra state from the used replies; return extra diagnostics."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Return the strategy's resumable state (the rule's moments)."""
        return {"rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (before training starts)."""
        self.rule.load_state_dict(state["rule"])


UPDATE_SQ_NORM_KEY = "update-sq-norm"


@dataclass
class Candidate:
    """One client reply, unpacked: who sent it, its arrays and metrics."""

    node: int | str
    arrays: Arrays | None
    metrics: Mapping[str, Any]
    source: Any = None  # the original reply object, for the adapter
    problem: str | None = None  # set when the reply could not even be unpacked


@dataclass
class ScreenReport:
    """Counts for one round and phase, as written to results.json."""

    received: int = 0
    failed: int = 0
    rejected: int = 0
    used: int = 0
    rejections: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-able data."""
        return {
            "received": self.received,
            "failed": self.failed,
            "rejected": self.rejected,
            "used": self.used,
            "rejections": list(self.rejections),
        }


def _check_metrics(metrics: Mapping[str, Any], weight_key: str) -> str | None:
    weight = metrics.get(weight_key)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        return f"metric '{weight_key}' missing or not a number"
    if not math.isfinite(weight) or weight <= 0:
        return f"metric '{weight_key}' must be finite and > 0, got {weight}"
    if UPDATE_SQ_NORM_KEY in metrics:
        norm = metrics[UPDATE_SQ_NORM_KEY]
        if not isinstance(norm, int | float) or not math.isfinite(norm) or norm < 0:
            return f"metric '{UPDATE_SQ_NORM_KEY}' must be finite and >= 0, got {norm}"
    return None


def reject_reason(
    arrays: Mapping[str, NDArray[Any]] | None,
    metrics: Mapping[str, Any],
    reference: Mapping[str, NDArray[Any]] | None,
    weight_key: str,
) -> str | None:
    """Return why a reply must be dropped, or None when it is usable.

    ``arrays`` is None for evaluation replies (metrics only). ``reference``
    is what the server sent this round; replies must match its names, shapes
    and dtypes exactly (no broadcasting, no silent casts).
    """
    if arrays is not None:
        if reference is not None:
            if set(arrays) != set(reference):
                return "array names differ from the global model's"
            for name, ref in reference.items():
                got = arrays[name]
                if got.shape != ref.shape:
                    return f"array '{name}' has shape {got.shape}, expected {ref.shape}"
                if got.dtype != ref.dtype:
                    return f"array '{name}' has dtype {got.dtype}, expected {ref.dtype}"
        for name, value in arrays.items():
            if value.dtype.kind in "fc" and not math.isfinite(float(np.sum(value))):
                return f"array '{name}' contains NaN or Inf"
    return _check_metrics(metrics, weight_key)


def screen(
    candidates: Sequence[Candidate | str],
    reference: Mapping[str, NDArray[Any]] | None,
    weight_key: str,
    round_label: str,
    extra_check: Callable[[Candidate], str | None] | None = None,
) -> tuple[list[Candidate], ScreenReport]:
    """Split replies into usable ones and a report; log each rejection.

    A ``str`` in ``candidates`` stands for a failed reply (its error text).
    ``extra_check`` adds strategy-specific checks (e.g. Fed-LAMB's moments).
    ``np.sum`` of a float array is non-finite iff it holds NaN/Inf (or its
    values are so large the sum overflows, which is rejected too).
    """
    report = ScreenReport(received=len(candidates))
    valid: list[Candidate] = []
    for candidate in candidates:
        if isinstance(candidate, str):
            report.failed += 1
            continue
        reason = candidate.problem or reject_reason(
            candidate.arrays, candidate.metrics, reference, weight_key
        )
        if reason is None and extra_check is not None:
            reason = extra_check(candidate)
        if reason is None:
            valid.append(candidate)
            continue
        report.rejected += 1
        report.rejections.append(f"node {candidate.node}: {reason}")
        log(WARNING, "%s: rejected reply from node %s: %s",
            round_label, candidate.node, reason)  # fmt: skip
    report.used = len(valid)
    if candidates and not valid:
        log(WARNING, "%s: no usable replies (%s failed, %s rejected)",
            round_label, report.failed, report.rejected)  # fmt: skip
    return valid, report


def canonical_order(valid: list[Candidate], weight_key: str) -> list[Candidate]:
    """Sort replies by content (weight, reported norm) instead of arrival.

    Floating-point sums depend on order; sorting by what the replies carry
    makes the aggregate independent of arrival order and node ids, so a
    resumed run reproduces an uninterrupted one exactly.
    """

    def key(c: Candidate) -> tuple[float, float]:
        return (
            float(c.metrics[weight_key]),
            float(c.metrics.get(UPDATE_SQ_NORM_KEY, -1.0)),
        )

    return sorted(valid, key=key)


def apply_rule(
    rule: ServerRule,
    reference: Arrays,
    valid: Sequence[Candidate],
    weight_key: str,
) -> tuple[Arrays, dict[str, float | None]]:
    """Run ``rule`` on screened replies; return new arrays and diagnostics.

    Client-reported ``update-sq-norm`` values are used when every reply has
    one (secure-aggregation friendly); otherwise the rule recomputes them.
    """
    ordered = canonical_order(list(valid), weight_key)
    norms = [c.metrics.get(UPDATE_SQ_NORM_KEY) for c in ordered]
    reported = None if any(n is None for n in norms) else [float(n) for n in norms]
    new, diagnostics = rule.step(
        reference,
        [c.arrays for c in ordered],  # type: ignore[misc]
        [float(c.metrics[weight_key]) for c in ordered],
        reported,
    )
    clean: dict[str, float | None] = {
        k: (v if math.isfinite(v) else None) for k, v in diagnostics.items()
    }
    clean["norms-reported"] = float(reported is not None)
    return new, clean


def evaluation_average(previous: Arrays, new: Arrays) -> Arrays:
    """Return (w_t + w_{t+1})/2, the model FedExP/FedDuA evaluate (spec §5.3)."""
    return {
        k: ((previous[k] + x) / 2).astype(x.dtype) if x.dtype.kind == "f" else x
        for k, x in new.items()
    }
