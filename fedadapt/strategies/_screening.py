"""Reply screening: drop bad client replies instead of crashing the federation.

Flower's stock strategies raise (and end the run) when one reply is
inconsistent, and average NaN straight into the global model. Every fedadapt
strategy screens train replies first: a reply whose arrays are non-finite or
differ in keys, shape or dtype from what the server sent, or whose metrics
lack a positive finite ``num-examples`` (or carry a negative or non-finite
``update-sq-norm``), is dropped with a warning and counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

UPDATE_SQ_NORM_KEY = "update-sq-norm"


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
    is what the server sent this round; replies must match its keys, shapes
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
            if value.dtype.kind in "fc" and not np.all(np.isfinite(value)):
                return f"array '{name}' contains NaN or Inf"
    return _check_metrics(metrics, weight_key)


def _unpack(message: Message, with_arrays: bool) -> tuple[dict | None, dict] | str:
    content = message.content
    if len(content.metric_records) != 1:
        return "expected exactly one MetricRecord"
    metrics = dict(next(iter(content.metric_records.values())))
    if not with_arrays:
        return None, metrics
    if len(content.array_records) != 1:
        return "expected exactly one ArrayRecord"
    record = next(iter(content.array_records.values()))
    return {k: v.numpy() for k, v in record.items()}, metrics


class ReplyScreening:
    """Mixin for ``flwr.serverapp.strategy.FedAvg`` subclasses.

    Put it first in the bases. It remembers the arrays sent each round,
    screens replies before the parent aggregates them and keeps a per-round
    report in :attr:`round_reports` (``received``, ``failed``, ``rejected``,
    ``used``, the rejection reasons and the aggregated metrics).
    """

    weighted_by_key: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.round_reports: dict[int, dict[str, Any]] = {}
        self._sent: dict[str, NDArray[Any]] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global arrays, then sample and configure as Flower does."""
        self._sent = {k: v.numpy() for k, v in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)  # type: ignore[misc]

    def screen_replies(
        self, server_round: int, replies: Iterable[Message], train: bool
    ) -> list[Message]:
        """Return the usable replies; count and log the others."""
        replies = list(replies)
        report = {"received": len(replies), "failed": 0, "rejected": 0}
        reasons: list[str] = []
        valid: list[Message] = []
        for message in replies:
            node = message.metadata.src_node_id
            if message.has_error():
                report["failed"] += 1
                continue
            unpacked = _unpack(message, with_arrays=train)
            reason = (
                unpacked
                if isinstance(unpacked, str)
                else reject_reason(
                    unpacked[0],
                    unpacked[1],
                    self._sent if train else None,
                    self.weighted_by_key,
                )
            )
            if reason is None:
                valid.append(message)
            else:
                report["rejected"] += 1
                reasons.append(f"node {node}: {reason}")
                log(WARNING, "Round %s: rejected reply from node %s: %s",
                    server_round, node, reason)  # fmt: skip
        report["used"] = len(valid)
        phase = "train" if train else "evaluate"
        entry = self.round_reports.setdefault(server_round, {})
        entry[f"{phase}_replies"] = {**report, "rejections": reasons}
        if replies and not valid:
            log(WARNING, "Round %s: no valid %s replies (%s failed, %s rejected)%s",
                server_round, phase, report["failed"], report["rejected"],
                "; keeping the current global model" if train else "")  # fmt: skip
        return valid

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen the replies, then aggregate the usable ones as the parent does."""
        valid = self.screen_replies(server_round, replies, train=True)
        if not valid:
            return None, None
        arrays, metrics = super().aggregate_train(server_round, valid)  # type: ignore[misc]
        if metrics is not None:
            self.round_reports[server_round]["train"] = dict(metrics)
        return arrays, metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Screen evaluation replies, then aggregate their metrics."""
        valid = self.screen_replies(server_round, replies, train=False)
        if not valid:
            return None
        metrics = super().aggregate_evaluate(server_round, valid)  # type: ignore[misc]
        if metrics is not None:
            self.round_reports[server_round]["federated_eval"] = dict(metrics)
        return metrics
