"""Reply screening: which client replies a round may use, and why not.

Flower's stock strategies end the run when one reply is inconsistent and
average NaN straight into the global model. Every fedadapt strategy screens
its replies first (:func:`screen`): a train reply whose arrays differ in
names, shape or dtype from what the server sent, or any reply whose metrics
lack a positive finite weight (``num-examples``; under uniform weighting a
missing one counts as 1) or carry a negative or non-finite
``update-sq-norm``, is dropped with a warning and counted in a
:class:`ScreenReport` (what results.json records per round). Values are
checked later, on the aggregate (:func:`fedadapt.strategies.adapter.apply_rule`).
Everything here is plain Python over mappings of arrays and metrics; the
Flower adapters unpack messages into :class:`TrainReply` /
:class:`EvaluateReply` first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, TypeVar

from flwr.common.logger import log
from numpy.typing import NDArray

from fedadapt.strategies import wire
from fedadapt.strategies.arrays import array_specs, dtype_name

#: Relative tolerance between a reported and the server's ‖Δ_i‖²: float32
#: sums over millions of entries differ by ~1e-5 relative (benchmarked on
#: ResNet-18 arrays); 1e-3 leaves a wide margin and still catches any lie
#: that could matter.
NORM_RTOL = 1e-3

#: Characters of a failed reply's error text kept (its end) in logs and errors.
ERROR_TEXT_CHARS = 500


def _tail(text: str) -> str:
    """Return the end of an error text (a traceback ends with the message)."""
    text = text.strip()
    return text if len(text) <= ERROR_TEXT_CHARS else "…" + text[-ERROR_TEXT_CHARS:]


#: How Flower 1.41/1.42 words a ClientApp's exception in an error reply:
#: ``str(type(ex)) + ":<'" + str(ex) + "'>"`` (run_clientapp.py, vce_api.py)
_FLOWER_EXCEPTION = re.compile(r"<class '([^']*)'>:<'(.*)'>", re.DOTALL)


def unwrap_flower_error(reason: str) -> str:
    """Return ``"<Type>: <message>"`` for Flower's ``<class '…'>:<'…'>`` wording.

    Any other text is returned as it is.
    """
    match = _FLOWER_EXCEPTION.fullmatch(reason.strip())
    return f"{match[1].rsplit('.', 1)[-1]}: {match[2]}" if match else reason


def failed_reply(node: int | str | None, error: str) -> str:
    """Return a failed reply as screened: ``"node <id>: <end of its error>"``.

    Flower reports a node that dropped out (or whose ClientApp raised) as a
    reply carrying an error; its node id and reason go to results.json, in
    one line: Flower's wrapping of an exception is undone
    (:func:`unwrap_flower_error`), and an error that names its node already
    (a node's data error: ``node 4711 data-path …``) is given as it is.
    """
    who = "node ?" if node is None else f"node {node}"
    text = unwrap_flower_error(error)
    match = _FLOWER_EXCEPTION.fullmatch(error.strip())
    if match and match[2].startswith(f"{who} "):
        return _tail(match[2])
    return f"{who}: {_tail(text) or 'no reason given'}"


@dataclass
class EvaluateReply:
    """One evaluate reply, unpacked: who sent it and its metrics."""

    node: int | str
    metrics: Mapping[str, Any]
    source: Any = None  # the original reply object, for the adapter
    problem: str | None = None  # set when the reply could not even be unpacked
    defaulted_weight: bool = False  # no weight sent; 1 under uniform weighting


@dataclass
class TrainReply(EvaluateReply):
    """One train reply, unpacked: its metrics, model and local-update arrays.

    ``arrays`` are plain NumPy arrays or :class:`~fedadapt.strategies.arrays.
    LazyArrays`; a reply with a ``problem`` carries none (empty).
    """

    arrays: Mapping[str, NDArray[Any]] = field(default_factory=dict)
    local_arrays: Mapping[str, NDArray[Any]] | None = None  # see LocalUpdate


#: A reply type screened by :func:`screen`.
Reply = TypeVar("Reply", bound=EvaluateReply)


@dataclass
class ScreenReport:
    """Counts for one round and phase, as written to results.json."""

    received: int = 0
    failed: int = 0
    rejected: int = 0
    used: int = 0
    rejections: list[str] = field(default_factory=list)
    norm_mismatches: int = 0
    clipped: int = 0
    errors: list[str] = field(default_factory=list)  # "node <id>: <error>"
    #: one record per reply, in arrival order (:meth:`note`; not in
    #: :meth:`as_dict`): what the app writes to clients.jsonl
    replies: list[dict[str, Any]] = field(default_factory=list)
    _by_reply: dict[int, dict[str, Any]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def note(
        self, candidate: EvaluateReply | str, status: str, reason: str | None = None
    ) -> dict[str, Any]:
        """Start the per-reply record of ``candidate`` (see :func:`reply_record`).

        Aggregation completes it through :meth:`record_of` (the server's
        ‖Δ_i‖², a mismatch, a clip, a late rejection), so every number in
        it is the one the round statistics used.
        """
        record = reply_record(candidate, status, reason)
        self.replies.append(record)
        if not isinstance(candidate, str):
            self._by_reply[id(candidate)] = record
        return record

    def record_of(self, candidate: EvaluateReply) -> dict[str, Any]:
        """Return the record :meth:`note` started for ``candidate``."""
        return self._by_reply[id(candidate)]

    def reject_late(
        self, candidate: EvaluateReply, reason: str, round_label: str
    ) -> None:
        """Count a reply rejected during aggregation (it was counted as used)."""
        self.used -= 1
        record = self._by_reply.get(id(candidate))
        if record is not None:
            record.update(status="rejected", reason=reason, server_sq_norm=None)
        self.count_rejection(candidate, reason, round_label)

    def count_rejection(
        self, candidate: EvaluateReply, reason: str, round_label: str
    ) -> None:
        """Count and log a rejected reply (screening and late rejections alike)."""
        self.rejected += 1
        self.rejections.append(f"node {candidate.node}: {reason}")
        log(
            WARNING,
            "%s: rejected reply from node %s: %s",
            round_label,
            candidate.node,
            reason,
        )

    def warn_none_usable(self, round_label: str) -> None:
        """Log that the round has no usable reply left, with this report's counts."""
        log(
            WARNING,
            "%s: no usable replies (%s failed, %s rejected)",
            round_label,
            self.failed,
            self.rejected,
        )

    def as_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-able data."""
        return {
            "received": self.received,
            "failed": self.failed,
            "rejected": self.rejected,
            "used": self.used,
            "rejections": list(self.rejections),
            "norm_mismatches": self.norm_mismatches,
            "clipped": self.clipped,
            "errors": list(self.errors),
        }

    def problems(self) -> list[str]:
        """Return the failed replies' error texts and the rejection reasons."""
        return [*self.errors, *self.rejections]


def _scalar(value: Any) -> float | int | str | None:
    """Return a metric as JSON holds it: numbers (non-finite: None), strings."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None  # arrays, lists: not per-reply scalars


def reply_record(
    candidate: EvaluateReply | str, status: str, reason: str | None = None
) -> dict[str, Any]:
    """Return one reply's record: who, what happened to it, what it reported.

    ``status`` is ``used``, ``rejected`` or ``failed`` (a failed reply is the
    ``str`` of :func:`failed_reply`; its node id is parsed back from it).
    ``metrics`` keeps the reply's scalar metrics as sent (non-finite values
    as None); ``server_sq_norm`` (the server's ‖Δ_i‖², None when it computed
    none), ``norm_mismatch``, ``clip_scale`` and ``clipped_by`` (which
    bound clipped it: ``norm-bound``, ``pull-cap`` or both) are filled in by aggregation
    (:func:`~fedadapt.strategies.adapter.apply_rule`), and so are
    ``selected`` (Krum, multi-Krum, Bulyan: whether the update entered Δ̄)
    and ``center_clip_scale`` (centered clipping: the factor its Δ_i − v
    got in the last iteration) and ``trimmed_share`` (the trimmed mean: the
    share of its coordinates cut); None where that aggregator is not in use.
    ``server_lr_without`` / ``step_guard``: the step guard's server step
    size without this client, and whether that one capped the round's step
    (FedExP/FedExPM/FedDuA; None otherwise); ``a_left_out``: whether the
    guard's A left its ‖Δ_i‖² out (None when A is the plain mean). ``consensus_cos`` /
    ``projected``: the cosine of its (clipped) update with the others' mean,
    and whether its part against that mean was removed (None when the
    opposing projection is off).
    """
    if isinstance(candidate, str):
        node: int | str | None = None
        if candidate.startswith("node ") and ": " in candidate:
            text = candidate[5 : candidate.index(": ")]
            node = int(text) if text.isdigit() else (None if text == "?" else text)
        return {"node": node, "status": status, "reason": reason or candidate}
    reported = candidate.metrics.get(wire.UPDATE_SQ_NORM)
    return {
        "node": candidate.node,
        "status": status,
        "reason": reason,
        "metrics": {
            k: _scalar(v)
            for k, v in candidate.metrics.items()
            if not isinstance(v, bytes | list | tuple)
        },
        "reported_sq_norm": _scalar(reported),
        "server_sq_norm": None,
        "norm_mismatch": None,
        "clip_scale": None,
        "clipped_by": None,
        "selected": None,
        "center_clip_scale": None,
        "trimmed_share": None,
        "server_lr_without": None,
        "step_guard": None,
        "a_left_out": None,
        "consensus_cos": None,
        "projected": None,
        "influence": None,
    }


def _check_metrics(
    metrics: Mapping[str, Any],
    weight_key: str,
    weight_optional: bool = False,
    norm_required: bool = False,
) -> str | None:
    weight = metrics.get(weight_key)
    if weight is None and weight_optional:
        pass  # uniform weighting: counted as 1 (see screen)
    elif isinstance(weight, bool) or not isinstance(weight, int | float):
        return f"metric '{weight_key}' missing or not a number"
    elif not math.isfinite(weight) or weight <= 0:
        return f"metric '{weight_key}' must be finite and > 0, got {weight}"
    if norm_required and wire.UPDATE_SQ_NORM not in metrics:
        return (
            f"metric '{wire.UPDATE_SQ_NORM}' missing: secure_aggregation=True "
            "uses the clients' norms and needs one in every train reply"
        )
    if wire.UPDATE_SQ_NORM in metrics:
        norm = metrics[wire.UPDATE_SQ_NORM]
        if not isinstance(norm, int | float) or not math.isfinite(norm) or norm < 0:
            return f"metric '{wire.UPDATE_SQ_NORM}' must be finite and >= 0, got {norm}"
    return None


def reject_reason(
    arrays: Mapping[str, Any] | None,
    metrics: Mapping[str, Any],
    reference: Mapping[str, NDArray[Any]] | None,
    weight_key: str,
    *,
    weight_optional: bool = False,
    norm_required: bool = False,
) -> str | None:
    """Return why a reply must be dropped before aggregation, or None.

    ``arrays`` is None for evaluation replies (metrics only). ``reference``
    is what the server sent this round; replies must match its names, shapes
    and dtypes exactly (no broadcasting, no silent casts). Values are checked
    later, on the aggregate (see
    :func:`~fedadapt.strategies.adapter.apply_rule`). ``weight_optional``
    accepts a missing ``weight_key`` (uniform weighting); ``norm_required``
    rejects a missing ``update-sq-norm`` (secure aggregation).
    """
    if arrays is not None and reference is not None:
        specs = array_specs(arrays)
        if set(specs) != set(reference):
            return "array names differ from the global model's"
        for name, ref in reference.items():
            shape, dtype = specs[name]
            if shape != ref.shape:
                return f"array '{name}' has shape {shape}, expected {ref.shape}"
            if dtype != dtype_name(ref.dtype):
                return f"array '{name}' has dtype {dtype}, expected {ref.dtype}"
    return _check_metrics(metrics, weight_key, weight_optional, norm_required)


def screen(
    candidates: Sequence[Reply | str],
    reference: Mapping[str, NDArray[Any]] | None,
    weight_key: str,
    round_label: str,
    extra_check: Callable[[Reply], str | None] | None = None,
    *,
    weight_optional: bool = False,
    norm_required: bool = False,
) -> tuple[list[Reply], ScreenReport]:
    """Split replies into usable ones and a report; log each rejection.

    A ``str`` in ``candidates`` stands for a failed reply
    (:func:`failed_reply`: node id and error text).
    ``extra_check`` adds checks of its own (run after the generic ones).
    With ``weight_optional`` (uniform weighting) a usable reply without
    ``weight_key`` gets weight 1 in its ``metrics`` (``defaulted_weight``
    set). ``norm_required``: see :func:`reject_reason`.
    ``np.sum`` of a float array is non-finite iff it holds NaN/Inf (or its
    values are so large the sum overflows, which is rejected too).
    """
    report = ScreenReport(received=len(candidates))
    valid: list[Reply] = []
    for candidate in candidates:
        if isinstance(candidate, str):  # a failed reply (see failed_reply)
            report.failed += 1
            report.errors.append(candidate)
            report.note(candidate, "failed")
            log(WARNING, "%s: failed reply from %s", round_label, candidate)
            continue
        arrays = candidate.arrays if isinstance(candidate, TrainReply) else None
        reason = candidate.problem or reject_reason(
            arrays,
            candidate.metrics,
            reference,
            weight_key,
            weight_optional=weight_optional,
            norm_required=norm_required,
        )
        if reason is None and extra_check is not None:
            reason = extra_check(candidate)
        if reason is None:
            if weight_key not in candidate.metrics:
                candidate.metrics = {**candidate.metrics, weight_key: 1}
                candidate.defaulted_weight = True
            report.note(candidate, "used")
            valid.append(candidate)
            continue
        report.note(candidate, "rejected", reason)
        report.count_rejection(candidate, reason, round_label)
    report.used = len(valid)
    if candidates and not valid:
        report.warn_none_usable(round_label)
    return valid, report


def canonical_order(valid: list[TrainReply], weight_key: str) -> list[TrainReply]:
    """Sort replies by content (weight, reported norm) instead of arrival.

    Floating-point sums depend on order; sorting by what the replies carry
    makes the aggregate independent of arrival order and node ids, so a
    resumed run reproduces an uninterrupted one exactly.
    """

    def key(c: TrainReply) -> tuple[float, float]:
        return (
            float(c.metrics[weight_key]),
            float(c.metrics.get(wire.UPDATE_SQ_NORM, -1.0)),
        )

    return sorted(valid, key=key)
