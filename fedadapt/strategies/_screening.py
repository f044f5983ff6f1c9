"""Reply screening and rule application shared by both Flower APIs.

Flower's stock strategies end the run when one reply is inconsistent and
average NaN straight into the global model. Every fedadapt strategy screens
train replies first: a reply whose arrays are non-finite or differ in names,
shape or dtype from what the server sent, or whose metrics lack a positive
finite weight (``num-examples``; under uniform weighting a missing one
counts as 1) or carry a negative or non-finite ``update-sq-norm``, is
dropped with a warning and counted. A reported
``update-sq-norm`` never steers the step unless the strategy runs in
secure-aggregation mode: the server uses its own ‖Δ_i‖² and counts the
mismatches (:class:`RuleHost`). Everything here is plain NumPy over
mappings of arrays; the Flower adapters only unpack messages into that form.

Cost: replies are checked from array *metadata* (names, shapes, dtypes) and
read one array at a time while the rule sums them (:class:`LazyArrays`).
Reading is a read-only NumPy view of the serialised bytes
(:func:`array_view`), not a copy, so a round holds no copy of any reply.
Non-finite values are caught on the aggregate (one cheap pass); only then
are the replies scanned one by one to find and drop the culprits.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from logging import ERROR, WARNING
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
from flwr.common.logger import log
from numpy.typing import NDArray

from fedadapt._validation import check_choice, check_scalar
from fedadapt.strategies.core import (
    Arrays,
    RoundStatistics,
    ServerRule,
    Trainable,
    untrained,
)
from fedadapt.strategies.core.base import AGGREGATIONS

if TYPE_CHECKING:
    from fedadapt.strategies.local_update import LocalUpdate

#: Default of ``max_update_norm_ratio``: an update above 5x the round's
#: median update norm is flagged and scaled down to the median norm of the
#: unflagged updates. Honest
#: clients measured up to 2.7x the median (max/median per round; digits-mlp
#: over 10 clients, Dirichlet α = 0.1 with Adam/Δ-SGD clients, α = 0.05,
#: shards, IID; synthetic-linreg; mnist5k-cnn: docs/failures.md), so 5 leaves
#: them untouched with a margin of almost 2; a flagged client weighs like one
#: typical client, and an unflagged one at most 5x a typical one.
DEFAULT_NORM_RATIO = 5.0


class ScreeningKwargs(TypedDict, total=False):
    """fedadapt's options, accepted by every strategy (see :class:`RuleHost`)."""

    secure_aggregation: bool
    max_update_norm: float
    max_update_norm_ratio: float | None
    aggregation: str
    trim_fraction: float
    max_failed_rounds: int
    trainable: Trainable | None


class RuleHost:
    """What both Flower adapters share: the rule, screening, reports and state.

    Parameters
    ----------
    rule : ServerRule
        The framework-free update rule (:mod:`fedadapt.strategies.core`).
    average_last_two : bool (default: False)
        Evaluate (w_t + w_{t+1})/2 instead of w_{t+1}; training continues
        from w_{t+1} (FedExP, arXiv:2301.09604; FedDuA §5.1 does the same).
    secure_aggregation : bool (default: False)
        Secure-aggregation mode: use the clients' reported ``update-sq-norm``
        as given (a secure aggregator reveals only sums, so the server cannot
        check them). A rule that needs the norms (FedExP, FedDuA) then
        rejects, with a warning and a count, every train reply without one:
        a secure aggregator could not compute it either, so a silent
        fallback to the server's own norms would run a different mode than
        the one asked for (our choice). Off (default): the server computes
        each ‖Δ_i‖² from the
        arrays while summing them, uses its own value, and logs and counts
        (``norm_mismatches``) every reported value that differs by more than
        :data:`NORM_RTOL` relative. A mismatching reply is kept, not dropped:
        a rounding disagreement must never cost an honest client its reply,
        and with the server's norm a lie no longer changes the step.
    max_update_norm : float (default: 0.0)
        C > 0 clips each client's update to ‖Δ_i‖ ≤ C before it enters Δ̄
        and A (counted as ``clipped``); 0 turns clipping off. Not with
        ``secure_aggregation`` (clip on the clients there).
    max_update_norm_ratio : float | None (default: None)
        k > 0: the detection threshold of norm bounding (Sun et al. 2019). A
        client update with ‖Δ_i‖ > k·m, m = median_j ‖Δ_j‖ of the round, is
        scaled down to the median norm of the updates not flagged before it
        enters Δ̄ and A (counted as ``clipped``, k·m recorded as the
        diagnostic ``update-norm-bound``), so a flagged client weighs like
        one typical client, however large its update (our choice: Sun et al.
        bound to a fixed M, and clipping to k·m left a ×1e6 client at
        22–34 % off the honest loss, docs/failures.md;
        :func:`~fedadapt.strategies.core.base.clip_scales`). Updates at or
        below k·m are untouched: a round without an outlier is aggregated
        exactly as without clipping. With ``max_update_norm`` the smaller
        factor applies. None =
        :data:`DEFAULT_NORM_RATIO` (5), or off under ``secure_aggregation``
        (the server sees only sums there); 0 = off.
    aggregation : str (default: "mean")
        ``"mean"`` (Σω_iΔ_i), ``"median"`` or ``"trimmed_mean"``: the
        coordinate-wise median / trimmed mean of the updates as the Δ̄ the
        rule steps on (Flower's FedMedian / FedTrimmedAvg applied to
        updates, composed with any rule; see
        :meth:`~fedadapt.strategies.core.ServerRule.statistics`). Not with
        ``secure_aggregation``.
    trim_fraction : float (default: 0.2)
        Fraction cut from each end per coordinate by ``"trimmed_mean"``, in
        [0, 0.5) (Flower's FedTrimmedAvg ``beta``).
    max_failed_rounds : int (default: 3)
        After this many consecutive rounds in which every reply failed or
        was rejected, :class:`FederationFailedError` (with the clients' error
        texts) ends the run; 0 never stops.
    trainable : Collection[str] | Callable[[str], bool] | None (default: None)
        Which arrays are trained: their names (e.g. ``[n for n, _ in
        model.named_parameters()]``) or a predicate ``name -> bool``. The
        others are averaged and kept out of Δ̄'s adaptive part, the
        preconditioner and the norms (the server's ‖Δ_i‖², so a client's
        ``update-sq-norm`` must cover exactly the trained arrays). None: the
        rule's default (FedExP/FedDuA: all float arrays but BatchNorm
        buffers; the others: all float arrays). Non-float arrays are never
        trained. Names that the global model lacks raise ``ValueError`` when
        the first round is configured.

    Attributes
    ----------
    rule : ServerRule
        As given.
    round_reports : dict[int, dict]
        Per round: ``train_replies`` / ``evaluate_replies`` counts and
        rejection reasons, aggregated ``train`` / ``federated_eval`` metrics
        and the rule's ``diagnostics`` (server step size, norms).
    """

    #: the server half of the algorithm's client-side part (None: plain
    #: clients); set by the adapters' ``local_update`` argument
    local_update: LocalUpdate | None = None

    #: whether replies key the rule's client state by array name (Message
    #: API) rather than by position (legacy parameter lists)
    client_state_named: bool = True

    def __init__(
        self,
        rule: ServerRule,
        *args: Any,
        average_last_two: bool = False,
        secure_aggregation: bool = False,
        max_update_norm: float = 0.0,
        max_update_norm_ratio: float | None = None,
        aggregation: str = "mean",
        trim_fraction: float = 0.2,
        max_failed_rounds: int = 3,
        trainable: Trainable | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(rule, ServerRule):
            raise TypeError(f"rule must be a ServerRule, got {type(rule).__name__}")
        if trainable is not None:
            rule.plain_average = untrained(trainable)
        self.trainable = trainable
        self.max_update_norm = check_scalar("max_update_norm", max_update_norm, low=0)
        if check_scalar("max_failed_rounds", max_failed_rounds, low=0) % 1:
            raise ValueError(f"Invalid max_failed_rounds: {max_failed_rounds} (an int)")
        self.max_failed_rounds = int(max_failed_rounds)
        if secure_aggregation and self.max_update_norm > 0:
            raise ValueError(
                "max_update_norm needs the server's own norms; under "
                "secure_aggregation clip on the clients"
            )
        self.secure_aggregation = bool(secure_aggregation)
        self.max_update_norm_ratio = self._norm_ratio(max_update_norm_ratio)
        self.aggregation = check_choice("aggregation", aggregation, AGGREGATIONS)
        self.trim_fraction = check_scalar(
            "trim_fraction", trim_fraction, low=0, high=0.5, high_inclusive=False
        )
        if self.secure_aggregation and self.aggregation != "mean":
            raise ValueError(
                f"aggregation={aggregation!r} needs the individual updates; "
                "under secure_aggregation only their sum is known: use 'mean'"
            )
        super().__init__(*args, **kwargs)
        self.rule = rule
        self.average_last_two = bool(average_last_two)
        self.round_reports: dict[int, dict[str, Any]] = {}
        # problems of consecutive rounds without a usable reply
        self._failed_streak: list[list[str]] = []
        self._rounds_screened = 0

    def check_trainable(self, model: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` when ``trainable`` names arrays ``model`` lacks."""
        if self.trainable is None or callable(self.trainable):
            return
        missing = sorted(set(self.trainable) - set(model))
        if missing:
            shown = ", ".join(map(repr, list(model)[:8]))
            raise ValueError(
                f"trainable names arrays the global model does not have: "
                f"{', '.join(map(repr, missing))} (its arrays: {shown}"
                f"{', …' if len(model) > 8 else ''}); legacy strategies key "
                "arrays by position unless given array_names"
            )

    def _norm_ratio(self, ratio: float | None) -> float:
        """Return k of ``max_update_norm_ratio`` (None: the default, see above)."""
        if ratio is None:
            return 0.0 if self.secure_aggregation else DEFAULT_NORM_RATIO
        ratio = check_scalar("max_update_norm_ratio", ratio, low=0)
        if self.secure_aggregation and ratio > 0:
            raise ValueError(
                "max_update_norm_ratio needs the server's own norms; under "
                "secure_aggregation leave it at None or 0 (clip on the clients)"
            )
        return ratio

    def _client_state_check(
        self, reference: Arrays | None
    ) -> Callable[[Candidate], str | None] | None:
        """Return the screening check of the rule's client state (if it has one)."""
        if self.rule.client_state_key is None:
            return None
        model = reference if self.client_state_named else None
        accepted: list[Mapping[str, NDArray[Any]]] = []

        def check(candidate: Candidate) -> str | None:
            peer = accepted[0] if accepted else None
            reason = self.rule.check_client_state(candidate.client_state, model, peer)
            if reason is None and candidate.client_state is not None:
                accepted.append(candidate.client_state)
            return reason

        return check

    def run_rule(
        self,
        server_round: int,
        candidates: Sequence[Candidate | str],
        reference: Arrays | None,
        weight_key: str,
    ) -> tuple[Arrays | None, list[Candidate]]:
        """Screen train replies, apply the rule, record the round's report.

        Returns the new arrays and the replies used, or ``(None, [])`` when
        no reply is usable (or ``reference`` is None): the model is kept.
        Raises :class:`FederationFailedError` after ``max_failed_rounds``
        such rounds in a row.
        """
        label = f"Round {server_round}"
        entry = self.round_reports.setdefault(server_round, {})
        valid, report = screen(
            candidates, reference, weight_key, label,
            self._client_state_check(reference),
            weight_optional=self.rule.weighting == "uniform",
            norm_required=self.secure_aggregation and self.rule.needs_sq_norms,
        )  # fmt: skip
        new: Arrays | None = None
        diagnostics: dict[str, Any] = {}
        if valid and reference is not None:
            new, diagnostics, valid = apply_rule(
                self.rule, reference, valid, weight_key, report, label,
                secure_aggregation=self.secure_aggregation,
                max_norm=self.max_update_norm,
                max_norm_ratio=self.max_update_norm_ratio,
                aggregation=self.aggregation,
                trim_fraction=self.trim_fraction,
            )  # fmt: skip
        entry["train_replies"] = report.as_dict()
        self._count_failed_round(label, report, failed=report.used == 0)
        if new is None:
            return None, []
        if self.rule.client_state_key is not None:
            diagnostics.update(
                self.rule.aggregate_client_state(
                    [c.client_state for c in valid],  # type: ignore[misc]
                    [float(c.metrics[weight_key]) for c in valid],
                )
            )
        entry["diagnostics"] = diagnostics
        return new, valid

    def _count_failed_round(
        self, label: str, report: ScreenReport, failed: bool
    ) -> None:
        """Track consecutive rounds without a usable reply; stop after too many."""
        self._rounds_screened += 1
        if not failed:
            self._failed_streak = []
            return
        self._failed_streak.append(report.problems())
        limit = self.max_failed_rounds
        if not limit or len(self._failed_streak) < limit:
            return
        message = self._streak_failure(
            f"{label}: no usable train reply for {limit} consecutive rounds; "
            "stopping the run."
        )
        log(ERROR, "%s", message)
        raise FederationFailedError(message)

    def _streak_failure(self, what: str) -> str:
        """Record and return ``what`` + the failed streak's client errors."""
        problems = sorted({p for round_ in self._failed_streak for p in round_})
        self.failure = f"{what} Client errors and rejections: " + (
            "; ".join(problems) or "none (no replies arrived)"
        )
        return self.failure

    def unusable_run_failure(self) -> str | None:
        """Why a run whose every round so far lacked a usable train reply failed.

        None when some round used a reply (or none ran). A run can end so
        without reaching ``max_failed_rounds`` (fewer rounds than that, or
        ``max_failed_rounds=0``); it has not trained and must not count as
        completed (our choice).
        """
        streak = len(self._failed_streak)
        if not self._rounds_screened or streak != self._rounds_screened:
            return None
        return self._streak_failure(
            f"no round of the run used a train reply ({streak} rounds)."
        )

    def state_dict(self) -> dict[str, Any]:
        """Return the strategy's resumable state (the rule's moments).

        With a local update, its server half's state too (``local_update``).
        """
        if self.local_update is None:
            return {"rule": self.rule.state_dict()}
        return {
            "rule": self.rule.state_dict(),
            "local_update": self.local_update.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (before training starts).

        Checkpoints written before Fed-LAMB's v̂ moved into its rule keep it
        beside the rule's state; it is folded back in.
        """
        local = state.get("local_update")
        if local is not None and self.local_update is not None:
            self.local_update.load_state_dict(local)
        extra = {k: v for k, v in state.items() if k not in ("rule", "local_update")}
        self.rule.load_state_dict({**state["rule"], **extra})


UPDATE_SQ_NORM_KEY = "update-sq-norm"

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


def failed_reply(node: int | str | None, error: str) -> str:
    """Return a failed reply as screened: ``"node <id>: <end of its error>"``.

    Flower reports a node that dropped out (or whose ClientApp raised) as a
    reply carrying an error; its node id and reason go to results.json.
    """
    who = "node ?" if node is None else f"node {node}"
    return f"{who}: {_tail(error) or 'no reason given'}"


class FederationFailedError(RuntimeError):
    """Every reply failed or was rejected for too many consecutive rounds."""


@dataclass
class Candidate:
    """One client reply, unpacked: who sent it, its arrays and metrics."""

    node: int | str
    arrays: Mapping[str, NDArray[Any]] | None  # plain or LazyArrays
    metrics: Mapping[str, Any]
    source: Any = None  # the original reply object, for the adapter
    problem: str | None = None  # set when the reply could not even be unpacked
    client_state: Mapping[str, NDArray[Any]] | None = None  # see ServerRule
    local_arrays: Mapping[str, NDArray[Any]] | None = None  # see LocalUpdate
    defaulted_weight: bool = False  # no weight sent; 1 under uniform weighting


class ReplyError(ValueError):
    """A reply's data contradicts what it declared (raised mid-aggregation)."""

    def __init__(self, arrays: LazyArrays, reason: str) -> None:
        super().__init__(reason)
        self.arrays = arrays
        self.reason = reason


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: np.dtype[Any]) -> str:
    """Return ``str(dtype)``, cached.

    ``numpy.dtype.__str__`` is slow, and a round compares the dtypes of
    every array of every reply.
    """
    return str(dtype)


#: The ``.npy`` magic string and the ``stype`` Flower gives such bytes.
_NPY_MAGIC = b"\x93NUMPY"
_NPY_STYPE = "numpy.ndarray"


@functools.lru_cache(maxsize=4096)
def _npy_header(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], bool] | None:
    """Parse one ``.npy`` header (magic to end of header) with NumPy's reader.

    Cached: every client sends the same few hundred headers each round.
    None for anything :func:`array_view` leaves to ``Array.numpy()``.
    """
    stream = io.BytesIO(header)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            return None
    except ValueError:
        return None
    if dtype.hasobject or stream.tell() != len(header):
        return None
    return dtype, shape, fortran


def array_view(item: Any) -> NDArray[Any]:
    """Return a Flower ``Array``'s values as a read-only view of its bytes.

    The same array ``item.numpy()`` gives (``np.load``, no pickles), without
    copying the data: the header is parsed by NumPy's own ``.npy`` reader and
    the values are ``np.frombuffer`` over the rest, which must hold exactly
    ``prod(shape)·itemsize`` bytes. Anything else (another ``stype``, format
    version 3, object dtypes, a size mismatch, or objects that are not
    Flower Arrays) goes through ``item.numpy()`` and its errors.
    """
    data = getattr(item, "data", None)
    if (
        getattr(item, "stype", None) != _NPY_STYPE
        or not isinstance(data, bytes)
        or not data.startswith(_NPY_MAGIC)
        or len(data) < 10
    ):
        return item.numpy()
    length_bytes = 2 if data[6] == 1 else 4
    start = 8 + length_bytes
    end = start + int.from_bytes(data[8:start], "little")
    parsed = _npy_header(data[:end]) if end <= len(data) else None
    if parsed is None:
        return item.numpy()
    dtype, shape, fortran = parsed
    count = math.prod(shape)
    if len(data) - end != count * dtype.itemsize:
        return item.numpy()
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=end)
    return flat.reshape(shape, order="F" if fortran else "C")


class LazyArrays(Mapping[str, NDArray[Any]]):
    """A reply's arrays, deserialised on access and checked against their specs.

    ``record`` maps names to objects with ``numpy()``, ``shape`` and
    ``dtype`` (Flower's ``Array``); values are read-only views of the
    serialised bytes (:func:`array_view`). Reading an array whose data disagree with
    its declared shape or dtype raises :class:`ReplyError`.
    """

    def __init__(self, record: Mapping[str, Any]) -> None:
        self._record = record

    def __getitem__(self, key: str) -> NDArray[Any]:
        item = self._record[key]
        array = array_view(item)
        if array.shape != tuple(item.shape) or dtype_name(array.dtype) != str(
            item.dtype
        ):
            raise ReplyError(self, f"array '{key}' data do not match its metadata")
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._record)

    def __len__(self) -> int:
        return len(self._record)

    def specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Return the declared (shape, dtype) of every array, without deserialising."""
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in self._record.items()}


def array_specs(arrays: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Return {name: (shape, dtype)} of plain or lazy arrays."""
    if isinstance(arrays, LazyArrays):
        return arrays.specs()
    return {k: (tuple(a.shape), dtype_name(a.dtype)) for k, a in arrays.items()}


def all_finite(arrays: Mapping[str, NDArray[Any]]) -> bool:
    """Whether every float array is free of NaN/Inf (a sum overflows to inf)."""
    return all(
        math.isfinite(float(np.sum(a))) for a in arrays.values() if a.dtype.kind in "fc"
    )


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

    def reject_late(self, node: int | str, reason: str, round_label: str) -> None:
        """Count a reply rejected during aggregation (it was counted as used)."""
        self.rejected += 1
        self.used -= 1
        self.rejections.append(f"node {node}: {reason}")
        log(WARNING, "%s: rejected reply from node %s: %s", round_label, node, reason)

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
    if norm_required and UPDATE_SQ_NORM_KEY not in metrics:
        return (
            f"metric '{UPDATE_SQ_NORM_KEY}' missing: secure_aggregation=True "
            "uses the clients' norms and needs one in every train reply"
        )
    if UPDATE_SQ_NORM_KEY in metrics:
        norm = metrics[UPDATE_SQ_NORM_KEY]
        if not isinstance(norm, int | float) or not math.isfinite(norm) or norm < 0:
            return f"metric '{UPDATE_SQ_NORM_KEY}' must be finite and >= 0, got {norm}"
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
    later, on the aggregate (see :func:`apply_rule`). ``weight_optional``
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
    candidates: Sequence[Candidate | str],
    reference: Mapping[str, NDArray[Any]] | None,
    weight_key: str,
    round_label: str,
    extra_check: Callable[[Candidate], str | None] | None = None,
    *,
    weight_optional: bool = False,
    norm_required: bool = False,
) -> tuple[list[Candidate], ScreenReport]:
    """Split replies into usable ones and a report; log each rejection.

    A ``str`` in ``candidates`` stands for a failed reply
    (:func:`failed_reply`: node id and error text).
    ``extra_check`` adds rule-specific checks (e.g. Fed-LAMB's moments).
    With ``weight_optional`` (uniform weighting) a usable reply without
    ``weight_key`` gets weight 1 in its ``metrics`` (``defaulted_weight``
    set). ``norm_required``: see :func:`reject_reason`.
    ``np.sum`` of a float array is non-finite iff it holds NaN/Inf (or its
    values are so large the sum overflows, which is rejected too).
    """
    report = ScreenReport(received=len(candidates))
    valid: list[Candidate] = []
    for candidate in candidates:
        if isinstance(candidate, str):  # a failed reply (see failed_reply)
            report.failed += 1
            report.errors.append(candidate)
            log(WARNING, "%s: failed reply from %s", round_label, candidate)
            continue
        reason = candidate.problem or reject_reason(
            candidate.arrays, candidate.metrics, reference, weight_key,
            weight_optional=weight_optional, norm_required=norm_required,
        )  # fmt: skip
        if reason is None and extra_check is not None:
            reason = extra_check(candidate)
        if reason is None:
            if weight_key not in candidate.metrics:
                candidate.metrics = {**candidate.metrics, weight_key: 1}
                candidate.defaulted_weight = True
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


def _statistics_finite(stats: RoundStatistics) -> bool:
    if stats.mean_sq_norm is not None and not math.isfinite(stats.mean_sq_norm):
        return False
    return all_finite(stats.mean_update)


def apply_rule(
    rule: ServerRule,
    reference: Arrays,
    valid: Sequence[Candidate],
    weight_key: str,
    report: ScreenReport,
    round_label: str,
    *,
    secure_aggregation: bool = False,
    max_norm: float = 0.0,
    max_norm_ratio: float = 0.0,
    aggregation: str = "mean",
    trim_fraction: float = 0.2,
) -> tuple[Arrays | None, dict[str, float | None], list[Candidate]]:
    """Run ``rule`` on screened replies; return new arrays, diagnostics, used.

    Client-reported ``update-sq-norm`` values are used as given only with
    ``secure_aggregation`` (and when every reply has one). Otherwise the rule
    computes each ‖Δ_i‖² while summing the arrays and uses its own value;
    reported values off by more than :data:`NORM_RTOL` are logged and counted
    in ``report.norm_mismatches`` (the reply is kept). ``max_norm`` and
    ``max_norm_ratio`` > 0 clip each update, ``aggregation`` and
    ``trim_fraction`` choose how Δ̄ is formed (see
    :meth:`ServerRule.statistics`); clipped updates are counted in
    ``report.clipped`` and the bound is the diagnostic ``update-norm-bound``.
    Replies whose data turn out inconsistent or non-finite are dropped here
    (counted in ``report``) and the round is aggregated again without them;
    ``(None, {}, [])`` when none remain.
    """
    ordered = canonical_order(list(valid), weight_key)
    while ordered:
        norms = [c.metrics.get(UPDATE_SQ_NORM_KEY) for c in ordered]
        trusted = None
        if secure_aggregation and all(n is not None for n in norms):
            trusted = [float(n) for n in norms]  # type: ignore[arg-type]
        try:
            stats = rule.statistics(
                reference,
                [c.arrays for c in ordered],  # type: ignore[misc]
                [float(c.metrics[weight_key]) for c in ordered],
                trusted,
                max_norm=max_norm,
                max_norm_ratio=max_norm_ratio,
                aggregation=aggregation,
                trim_fraction=trim_fraction,
            )
        except ReplyError as error:
            bad = [c for c in ordered if c.arrays is error.arrays]
            reason = error.reason
        else:
            if _statistics_finite(stats):
                break
            bad = [c for c in ordered if not all_finite(c.arrays)]  # type: ignore[arg-type]
            reason = "arrays contain NaN or Inf"
            if not bad:  # finite inputs whose sums overflow: nothing to single out
                bad, reason = list(ordered), "aggregate overflowed (values too large)"
        for candidate in bad:
            report.reject_late(candidate.node, reason, round_label)
        ordered = [c for c in ordered if all(c is not b for b in bad)]
    else:
        log(WARNING, "%s: no usable replies (%s failed, %s rejected)",
            round_label, report.failed, report.rejected)  # fmt: skip
        return None, {}, []
    if stats.client_sq_norms is not None:
        _check_reported_norms(ordered, stats.client_sq_norms, report, round_label)
        if stats.clip_scales is not None:
            _count_clipped(ordered, stats.client_sq_norms, stats.clip_scales,
                           report, round_label)  # fmt: skip
    new, diagnostics = rule.apply(reference, stats)
    if stats.norm_bound is not None:
        diagnostics["update-norm-bound"] = stats.norm_bound
    clean: dict[str, float | None] = {
        k: (v if math.isfinite(v) else None) for k, v in diagnostics.items()
    }
    clean["norms-trusted"] = float(trusted is not None)
    return new, clean, ordered


def _count_clipped(
    used: Sequence[Candidate],
    sq_norms: Sequence[float],
    scales: Sequence[float],
    report: ScreenReport,
    round_label: str,
) -> None:
    """Count and log each clipped update (naming its node and both norms)."""
    for candidate, sq, scale in zip(used, sq_norms, scales, strict=True):
        if scale < 1:
            report.clipped += 1
            log(WARNING, "%s: clipped the update of node %s from norm %.6g to %.6g",
                round_label, candidate.node, math.sqrt(sq),
                scale * math.sqrt(sq))  # fmt: skip


def _check_reported_norms(
    used: Sequence[Candidate],
    computed: Sequence[float],
    report: ScreenReport,
    round_label: str,
) -> None:
    """Log and count each reported ‖Δ_i‖² that disagrees with the server's."""
    for candidate, own in zip(used, computed, strict=True):
        claimed = candidate.metrics.get(UPDATE_SQ_NORM_KEY)
        if claimed is None or math.isclose(claimed, own, rel_tol=NORM_RTOL):
            continue
        report.norm_mismatches += 1
        log(WARNING, "%s: node %s reported %s = %.6g but its arrays give %.6g; "
            "using the server's value", round_label, candidate.node,
            UPDATE_SQ_NORM_KEY, claimed, own)  # fmt: skip


def evaluation_average(previous: Arrays, new: Arrays) -> Arrays:
    """Return (w_t + w_{t+1})/2, the model FedExP/FedDuA evaluate.

    FedExP (arXiv:2301.09604) reports the average of the last two
    iterates, whose extrapolated steps oscillate; FedDuA (§5.1) does the
    same "as in FedExP". Non-float arrays are taken from w_{t+1}.
    """
    return {
        k: ((previous[k] + x) / 2).astype(x.dtype) if x.dtype.kind == "f" else x
        for k, x in new.items()
    }
