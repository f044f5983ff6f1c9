"""The Message-API adapter: Flower samples and configures, a core rule updates.

:class:`RuleStrategy` is ``flwr.serverapp.strategy.FedAvg`` with
``aggregate_train`` replaced by reply screening + a
:class:`~fedadapt.strategies.core.ServerRule`. Sampling, configuration,
metric aggregation and the round loop (``start``) stay Flower's. Every
Message-API strategy of fedadapt is this class with one rule; the public
classes (:class:`~fedadapt.strategies.FedAdam`, ...) only build the rule.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any, Unpack

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import SType
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from fedadapt.strategies._screening import (
    Candidate,
    LazyArrays,
    RuleHost,
    ScreeningKwargs,
    evaluation_average,
    failed_reply,
    screen,
)
from fedadapt.strategies.core import Arrays, ServerRule


class FedAvgKwargs(ScreeningKwargs, total=False):
    """Arguments of ``flwr.serverapp.strategy.FedAvg``, passed through unchanged.

    Plus fedadapt's ``secure_aggregation``, ``max_update_norm`` and
    ``max_failed_rounds`` (see :class:`~fedadapt.strategies._screening.RuleHost`).
    See Flower's documentation for the others: ``fraction_train``,
    ``fraction_evaluate``, ``min_train_nodes``, ``min_evaluate_nodes``,
    ``min_available_nodes``, ``weighted_by_key``, ``arrayrecord_key``,
    ``configrecord_key``, ``train_metrics_aggr_fn``,
    ``evaluate_metrics_aggr_fn``.
    """

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    weighted_by_key: str
    arrayrecord_key: str
    configrecord_key: str
    train_metrics_aggr_fn: Callable[..., MetricRecord] | None
    evaluate_metrics_aggr_fn: Callable[..., MetricRecord] | None


def _to_numpy(record: ArrayRecord) -> Arrays:
    return {k: v.numpy() for k, v in record.items()}


def _to_array(array: NDArray[Any]) -> Array:
    """Return ``Array(array)``, serialised with one copy instead of three.

    The bytes are exactly what ``np.save`` writes (Flower's serialisation):
    NumPy's own ``.npy`` 1.0 header, then the values in C order, joined
    straight from the array's buffer (``np.save`` into a ``BytesIO`` copies
    them into chunks, the stream and its final value). Other arrays
    (non-C-contiguous, object dtype, headers that need format 2.0) go
    through ``Array(array)``.
    """
    if array.dtype.hasobject or not array.flags.c_contiguous:
        return Array(array)
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(
            header, np.lib.format.header_data_from_array_1_0(array)
        )
    except ValueError:
        return Array(array)
    data = b"".join((header.getvalue(), array.reshape(-1).view(np.uint8).data))
    return Array(
        dtype=str(array.dtype), shape=tuple(array.shape), stype=SType.NUMPY, data=data
    )


def _to_record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord({k: _to_array(v) for k, v in arrays.items()})


def _recipients(messages: Iterable[Message]) -> dict[str, int]:
    """Map the id of each message sent (set when the grid pushed it) to its node."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages}


def _unpack(
    message: Message,
    with_arrays: bool,
    state_key: str | None = None,
    recipients: dict[str, int] | None = None,
) -> Candidate | str:
    """Unpack a reply into metrics, model arrays and the rule's client state.

    The client state is the ArrayRecord named ``state_key`` (when the rule
    has one); exactly one other ArrayRecord must hold the model. A failed
    reply is named by the node its message was sent to (``recipients``):
    the error Flower returns for a node that dropped out comes from the
    SuperLink, not from the node.
    """
    node = message.metadata.src_node_id
    if message.has_error():
        node = (recipients or {}).get(message.metadata.reply_to_message_id, node)
        reason = message.error.reason or f"error code {message.error.code}"
        return failed_reply(node, reason)
    content = message.content
    if len(content.metric_records) != 1:
        return Candidate(node, None, {}, message, "expected exactly one MetricRecord")
    metrics = dict(next(iter(content.metric_records.values())))
    if not with_arrays:
        return Candidate(node, None, metrics, message)
    records = dict(content.array_records)
    state = records.pop(state_key, None) if state_key is not None else None
    if len(records) != 1:
        return Candidate(node, None, metrics, message, "expected one ArrayRecord")
    arrays = LazyArrays(next(iter(records.values())))
    client_state = None if state is None else _to_numpy(state)
    return Candidate(node, arrays, metrics, message, client_state=client_state)


class RuleStrategy(RuleHost, flwr_strategy.FedAvg):
    """Flower's FedAvg with its aggregation replaced by a fedadapt rule.

    Parameters
    ----------
    rule : ServerRule
        The update rule, e.g. ``FedAdamRule(eta=0.01)``.
    average_last_two, secure_aggregation, max_update_norm, max_failed_rounds
        See :class:`~fedadapt.strategies._screening.RuleHost`.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.

    Attributes
    ----------
    rule, round_reports
        See :class:`~fedadapt.strategies._screening.RuleHost`.
    latest_arrays : ArrayRecord | None
        The global model this strategy produced last.
    """

    weighted_by_key: str
    train_metrics_aggr_fn: Callable[..., MetricRecord]

    def __init__(
        self,
        rule: ServerRule,
        *,
        average_last_two: bool = False,
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
        self._sent: Arrays | None = None
        self._asked: dict[str, list[Message]] = {"train": [], "evaluate": []}
        self._last_output: ArrayRecord | None = None
        self._evaluation: ArrayRecord | None = None
        self._evaluation_pair: tuple[Arrays, Arrays] | None = None

    def summary(self) -> None:
        """Log Flower's sampling summary and the rule with its hyperparameters."""
        log(INFO, "\t├──> Rule: %r", self.rule)
        super().summary()

    # --- Flower hooks ------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global arrays, sample and configure as Flower does.

        A rule's :meth:`~fedadapt.strategies.core.ServerRule.broadcast_state`
        (Fed-LAMB's v̂) travels with the model as a second ArrayRecord named
        by its ``client_state_key``.
        """
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._asked["train"] = messages  # the grid gives them ids when it sends
        self._sent = _to_numpy(arrays)
        state = self.rule.broadcast_state()
        if state is not None and self.rule.client_state_key is not None:
            record = _to_record(state)
            for message in messages:
                message.content[self.rule.client_state_key] = record
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen replies, apply the rule; ``(None, None)`` keeps the model."""
        key = self.rule.client_state_key
        asked = _recipients(self._asked["train"])
        candidates = [_unpack(m, True, key, asked) for m in replies]
        new, valid = self.run_rule(
            server_round, candidates, self._sent, self.weighted_by_key
        )
        if new is None:
            return None, None
        entry = self.round_reports[server_round]
        metrics = self.train_metrics_aggr_fn(
            [c.source.content for c in valid], self.weighted_by_key
        )
        entry["train"] = dict(metrics)
        record = _to_record(new)
        self._last_output = record
        self._evaluation = None
        self._evaluation_pair = (
            (self._sent, new)
            if self.average_last_two and self._sent is not None
            else None
        )
        return record, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure evaluation of the evaluation model (see average_last_two)."""
        if self.fraction_evaluate == 0.0:
            return []
        messages = list(
            super().configure_evaluate(
                server_round, self.evaluation_arrays(arrays), config, grid
            )
        )
        self._asked["evaluate"] = messages
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Screen evaluation replies, then aggregate their metrics as Flower does."""
        asked = _recipients(self._asked["evaluate"])
        candidates = [_unpack(m, False, recipients=asked) for m in replies]
        valid, report = screen(
            candidates, None, self.weighted_by_key, f"Round {server_round} evaluate"
        )
        entry = self.round_reports.setdefault(server_round, {})
        entry["evaluate_replies"] = report.as_dict()
        if not valid:
            return None
        metrics = super().aggregate_evaluate(server_round, [c.source for c in valid])
        if metrics is not None:
            entry["federated_eval"] = dict(metrics)
        return metrics

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run Flower's round loop; ``evaluate_fn`` sees the evaluation model."""
        wrapped = None
        if evaluate_fn is not None:

            def wrapped(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                return evaluate_fn(server_round, self.evaluation_arrays(arrays))

        return super().start(
            grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
            wrapped,
        )  # fmt: skip

    # --- state -----------------------------------------------------------------

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """Return the model to evaluate for global ``arrays``.

        With ``average_last_two`` that is (w_t + w_{t+1})/2 right after this
        strategy produced w_{t+1}; otherwise (or for any other arrays) the
        arrays themselves.
        """
        if self._evaluation_pair is None or arrays is not self._last_output:
            return arrays
        if self._evaluation is None:  # built on first use: rounds without
            # evaluation never pay for the average
            self._evaluation = _to_record(evaluation_average(*self._evaluation_pair))
        return self._evaluation

    @property
    def latest_arrays(self) -> ArrayRecord | None:
        """The global model this strategy produced last (None before any)."""
        return self._last_output
