"""The Message-API adapter: Flower samples and configures, a core rule updates.

:class:`RuleStrategy` is ``flwr.serverapp.strategy.FedAvg`` with
``aggregate_train`` replaced by reply screening + a
:class:`~fedadapt.strategies.core.ServerRule`. Sampling, configuration and
metric aggregation stay Flower's; ``start`` is Flower's round loop as of
its nightly (``should_stop``) plus ``start_round`` and the stop rule of
:class:`~fedadapt.strategies._control.RunControl`. Every Message-API
strategy of fedadapt is this class with one rule; the public classes
(:class:`~fedadapt.strategies.FedAdam`, ...) only build the rule.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any, Unpack

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from fedadapt.strategies import wire
from fedadapt.strategies._control import (
    CENTRAL,
    FEDERATED,
    TRAIN,
    RunControl,
    StopKwargs,
)
from fedadapt.strategies.adapter import RuleHost, ScreeningKwargs, evaluation_average
from fedadapt.strategies.arrays import LazyArrays
from fedadapt.strategies.core import Arrays, ServerRule, Trainable
from fedadapt.strategies.local_update import (
    LocalUpdate,
    aggregate_replies,
    round_config,
    screen_replies,
)
from fedadapt.strategies.screening import (
    EvaluateReply,
    TrainReply,
    failed_reply,
    screen,
)
from fedadapt.strategies.traffic import RoundTraffic, scalar_bytes


class FedAvgKwargs(ScreeningKwargs, StopKwargs, total=False):
    """Arguments of ``flwr.serverapp.strategy.FedAvg``, passed through unchanged.

    Plus fedadapt's ``secure_aggregation``, ``max_update_norm``,
    ``max_update_norm_ratio``, ``aggregation``, ``trim_fraction`` and
    ``max_failed_rounds`` (see :class:`~fedadapt.strategies.adapter.RuleHost`)
    and the stop rule's ``stop_*`` (see
    :class:`~fedadapt.strategies._control.RunControl`).
    See Flower's documentation for the others: ``fraction_train``,
    ``fraction_evaluate``, ``min_train_nodes``, ``min_evaluate_nodes``,
    ``min_available_nodes``, ``weighted_by_key``, ``arrayrecord_key``,
    ``configrecord_key``, ``train_metrics_aggr_fn``,
    ``evaluate_metrics_aggr_fn``. And ``local_update``: the server half of
    the algorithm's client-side part (see
    :class:`~fedadapt.strategies.local_update.LocalUpdate`). And
    ``evaluate_with_train``: federated evaluation folded into the train
    exchange (see :class:`RuleStrategy`).
    """

    local_update: LocalUpdate | None
    evaluate_with_train: bool
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


def _to_record(arrays: Arrays) -> ArrayRecord:
    """Serialise with Flower's own ``Array`` (``np.save``; docs/benchmarks.md)."""
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _describe_trainable(trainable: Trainable | None) -> str:
    if trainable is None:
        return "the rule's default (float arrays; FedExP/FedDuA: not BatchNorm buffers)"
    if callable(trainable):
        return f"those {getattr(trainable, '__name__', repr(trainable))} accepts"
    return f"{len(trainable)} named arrays"


def _record_bytes(content: RecordDict, scalars: str) -> tuple[list[bytes], int]:
    """Return a message's serialized arrays and the bytes of its ``scalars``.

    ``scalars`` is ``"config"`` or ``"metrics"`` (see
    :mod:`fedadapt.strategies.traffic`).
    """
    arrays = [a.data for r in content.array_records.values() for a in r.values()]
    records = content.config_records if scalars == "config" else content.metric_records
    return arrays, sum(scalar_bytes(r) for r in records.values())


def _recipients(messages: Iterable[Message]) -> dict[str, int]:
    """Map the id of each message sent (set when the grid pushed it) to its node."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages}


def _unpack_evaluate(
    message: Message, recipients: dict[str, int] | None = None
) -> EvaluateReply | str:
    """Unpack a reply into its metrics (a ``str``: a failed reply).

    A failed reply is named by the node its message was sent to
    (``recipients``): the error Flower returns for a node that dropped out
    comes from the SuperLink, not from the node.
    """
    node = message.metadata.src_node_id
    if message.has_error():
        node = (recipients or {}).get(message.metadata.reply_to_message_id, node)
        reason = message.error.reason or f"error code {message.error.code}"
        return failed_reply(node, reason)
    records = message.content.metric_records
    if len(records) != 1:
        return EvaluateReply(node, {}, message, "expected exactly one MetricRecord")
    return EvaluateReply(node, dict(next(iter(records.values()))), message)


def _unpack_train(
    message: Message, recipients: dict[str, int] | None = None
) -> TrainReply | str:
    """Unpack a reply into metrics, model arrays and a local update's arrays.

    A local update's arrays are the ArrayRecord named
    :data:`~fedadapt.strategies.wire.LOCAL_ARRAYS`; exactly one other
    ArrayRecord must hold the model. Failures as in :func:`_unpack_evaluate`.
    """
    reply = _unpack_evaluate(message, recipients)
    if isinstance(reply, str):
        return reply
    node, metrics = reply.node, reply.metrics
    if reply.problem is not None:
        return TrainReply(node, metrics, message, reply.problem)
    records = dict(message.content.array_records)
    local = records.pop(wire.LOCAL_ARRAYS, None)
    if len(records) != 1:
        return TrainReply(node, metrics, message, "expected one ArrayRecord")
    arrays = LazyArrays(next(iter(records.values())))
    return TrainReply(
        node,
        metrics,
        message,
        arrays=arrays,
        local_arrays=None if local is None else _to_numpy(local),
    )


def _take_evaluation(
    message: Message, recipients: dict[str, int] | None = None
) -> EvaluateReply | str:
    """Detach a train reply's folded evaluation (``evaluate-metrics``).

    The record is removed from the reply, so the train metrics are
    unpacked and aggregated without it. It comes back as an evaluate
    reply whose ``source`` is a message holding only it, as a separate
    evaluate exchange's reply would: Flower's metric aggregation reads
    both alike. A failed train reply is a failed evaluation too.
    """
    if message.has_error():
        failed = _unpack_evaluate(message, recipients)
        assert isinstance(failed, str)
        return failed
    node = message.metadata.src_node_id
    record = message.content.metric_records.get(wire.EVALUATE_METRICS)
    if record is None:
        problem = f"no '{wire.EVALUATE_METRICS}' in a train reply that asked for it"
        return EvaluateReply(node, {}, message, problem)
    del message.content[wire.EVALUATE_METRICS]
    content = RecordDict({wire.METRICS: record})
    source = Message(content, dst_node_id=node, message_type=MessageType.EVALUATE)
    return EvaluateReply(node, dict(record), source)


def _metrics_content(reply: TrainReply) -> RecordDict:
    """Return a used reply's content for Flower's metric aggregation.

    A reply accepted without a weight (uniform weighting) is given its
    weight 1 here too, so that Flower's weighted average can read it.
    """
    if not reply.defaulted_weight:
        content: RecordDict = reply.source.content
        return content
    return RecordDict({wire.METRICS: MetricRecord(dict(reply.metrics))})


class RuleStrategy(RuleHost, RunControl, flwr_strategy.FedAvg):
    """Flower's FedAvg with its aggregation replaced by a fedadapt rule.

    Parameters
    ----------
    rule : ServerRule
        The update rule, e.g. ``FedAdamRule(eta=0.01)``.
    average_last_two : bool (default: False)
        Return (w_t + w_{t+1})/2 as the round's model (what Flower
        evaluates, ``Result.arrays``) and keep w_{t+1}, from which the next
        round trains (FedExP, arXiv:2301.09604; FedDuA §5.1).
    secure_aggregation, max_update_norm, max_failed_rounds, trainable
        See :class:`~fedadapt.strategies.adapter.RuleHost`.
    max_update_norm_ratio, aggregation, trim_fraction
        See :class:`~fedadapt.strategies.adapter.RuleHost` (hostile clients).
    local_update : LocalUpdate | None (default: None)
        The server half of an algorithm's client-side part, e.g.
        :class:`~fedadapt.strategies.fedprox.FedProx`; its scalars join the
        train config, its arrays travel as the ArrayRecord
        ``local-update-arrays`` (see :mod:`fedadapt.strategies.local_update`).
    evaluate_with_train : bool (default: False)
        Fold federated evaluation into the train exchange: one exchange a
        round instead of two. Each train message asks its client to
        evaluate the received model first (``evaluate-first``), and the
        reply carries the scores as the MetricRecord ``evaluate-metrics``,
        aggregated as a separate evaluation's replies are. Round t's train
        message carries the model of round t − 1, so its federated
        evaluation scores that model: ``Result.evaluate_metrics_clientapp``
        is keyed by the round of the model scored (0: the initial model)
        and ``round_reports[t]["federated_eval"]["model-round"]`` says
        which. After the last round one evaluate exchange scores the final
        model (:attr:`final_evaluation`). Only with federated evaluation
        on (``fraction_evaluate > 0``), whose sample is then the round's
        training sample (the final exchange samples as Flower does); not
        with ``average_last_two``, whose clients train from another model
        than the one reported.
    weighted_by_key : str (default: "num-examples")
        The metric that holds each reply's weight. It weights the model
        update only under ``weighting="num_examples"`` (the rule's); a
        uniformly weighted rule (FedExP, FedDuA by default) averages the
        model uniformly and accepts train replies without it (weight 1).
        Flower's metric averages use it in both cases.
    stop_metric, stop_mode, stop_target, stop_patience, stop_min_delta
        See :class:`~fedadapt.strategies._control.RunControl` (the stop rule).
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.

    Attributes
    ----------
    rule, round_reports
        See :class:`~fedadapt.strategies.adapter.RuleHost`.
    stop_reason, stop_message, completed_round
        See :class:`~fedadapt.strategies._control.RunControl`.
    latest_arrays : ArrayRecord | None
        The global model this strategy returned last (the one evaluated).
    final_evaluation : dict | None
        With ``evaluate_with_train``, the final model's federated evaluation
        after :meth:`start`: ``federated_eval`` (the metrics and
        ``model-round``) and ``evaluate_replies`` (the reply counts); None
        before, or without it.
    training_arrays : ArrayRecord | None
        The model the next round trains from (w_{t+1}; the same as
        ``latest_arrays`` without ``average_last_two``).
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
        local_update = kwargs.pop("local_update", None)
        evaluate_with_train = kwargs.pop("evaluate_with_train", False)
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
        if evaluate_with_train and average_last_two:
            raise ValueError(
                "evaluate_with_train needs the clients to train from the model "
                "reported; with average_last_two they train from another"
            )
        self.local_update = local_update
        self.evaluate_with_train = evaluate_with_train
        self.final_evaluation: dict[str, Any] | None = None
        self._folded: MetricRecord | None = None  # this round's folded evaluation
        self._sent: Arrays | None = None
        self._traffic: RoundTraffic | None = None  # the train messages' bytes
        self._asked: dict[str, list[Message]] = {"train": [], "evaluate": []}
        self._last_output: ArrayRecord | None = None
        # with average_last_two: w_{t+1}, which training continues from
        self._iterate: Arrays | None = None
        self._iterate_record: ArrayRecord | None = None

    def summary(self) -> None:
        """Log the rule, what it trains and Flower's sampling summary.

        Flower's own summary says "Weighted by: '<weighted_by_key>'", which
        is untrue for the model of a uniformly weighted rule (FedExP,
        FedDuA): here the line says what each weighting applies to.
        """
        key = self.weighted_by_key
        log(INFO, "\t├──> Rule: %r", self.rule)
        if self.stop_rule is not None:
            log(INFO, "\t├──> Stop rule: %r", self.stop_rule)
        log(INFO, "\t├──> Trained arrays: %s", _describe_trainable(self.trainable))
        log(INFO, "\t├──> Sampling:")
        log(
            INFO,
            "\t│\t├──Fraction: train (%.2f) | evaluate ( %.2f)",
            self.fraction_train,
            self.fraction_evaluate,
        )
        log(
            INFO,
            "\t│\t├──Minimum nodes: train (%d) | evaluate (%d)",
            self.min_train_nodes,
            self.min_evaluate_nodes,
        )
        log(INFO, "\t│\t└──Minimum available nodes: %d", self.min_available_nodes)
        log(INFO, "\t└──> Keys in records:")
        if self.rule.weighting == "uniform":
            log(
                INFO,
                "\t\t├── Model update weighted: uniformly (1/|S_t|; replies "
                "without '%s' are accepted)",
                key,
            )
        else:
            log(INFO, "\t\t├── Model update weighted by: '%s'", key)
        log(INFO, "\t\t├── Metrics weighted by: '%s'", key)
        log(INFO, "\t\t├── ArrayRecord key: '%s'", self.arrayrecord_key)
        log(INFO, "\t\t└── ConfigRecord key: '%s'", self.configrecord_key)

    # --- Flower hooks ------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample and configure as Flower does, training from w_{t+1}.

        When ``arrays`` is the model this strategy returned (with
        ``average_last_two`` the average of the last two iterates) the
        clients get the iterate w_{t+1} instead. A ``local_update``'s
        scalars join the train config and its arrays (Fed-LAMB's v̂) travel
        with the model as the ArrayRecord ``local-update-arrays``. With
        :attr:`folds_evaluation` the config asks for ``evaluate-first``.
        """
        self.check_trainable(arrays)
        arrays = self._training_record(arrays)
        self._sent = _to_numpy(arrays)
        local: Arrays = {}
        # N for both halves: the rule's stats.num_nodes, the local update's
        self.num_nodes = len(list(grid.get_node_ids()))
        if self.local_update is not None:  # its scalars join the train config
            scalars, local = round_config(
                self.local_update, server_round, self._sent, self.num_nodes
            )
            config = ConfigRecord({**config, **scalars})
        if self.folds_evaluation:
            config = ConfigRecord({**config, wire.EVALUATE_FIRST: True})
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._asked["train"] = messages  # the grid gives them ids when it sends
        if local:
            record = _to_record(local)
            for message in messages:
                message.content[wire.LOCAL_ARRAYS] = record
        self._traffic = RoundTraffic()
        for message in messages:
            data, config_bytes = _record_bytes(message.content, "config")
            self._traffic.add_sent(message.metadata.dst_node_id, data, config_bytes)
        return messages

    def _training_record(self, arrays: ArrayRecord) -> ArrayRecord:
        """Return the record clients train from when the global model is ``arrays``."""
        if arrays is self._last_output and self._iterate is not None:
            if self._iterate_record is None:
                self._iterate_record = _to_record(self._iterate)
            return self._iterate_record
        if self._resume_model is not None:
            iterate = self._resumed_iterate(_to_numpy(arrays))
            if iterate is not None:
                return _to_record(iterate)
        return arrays

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen replies, apply the rule; ``(None, None)`` keeps the model.

        Returns the model to evaluate and report: w_{t+1}, or with
        ``average_last_two`` (w_t + w_{t+1})/2 (w_{t+1} is kept for the next
        round's training). With :attr:`folds_evaluation` the replies' folded
        evaluations (of the model sent, round t − 1's) are aggregated first,
        as :meth:`aggregate_evaluate` does, into
        ``round_reports[t]["federated_eval"]`` (``model-round`` t − 1).
        """
        self.completed_round = server_round
        asked = _recipients(self._asked["train"])
        replies = list(replies)
        traffic, self._traffic = self._traffic or RoundTraffic(), None
        for message in replies:
            if not message.has_error():
                data, metric_bytes = _record_bytes(message.content, "metrics")
                traffic.add_received(message.metadata.src_node_id, data, metric_bytes)
        report = self.round_reports.setdefault(server_round, {})
        report["communication"] = traffic.as_dict()
        self._folded = None
        if self.folds_evaluation:  # scores of the model sent: round t − 1's
            evaluations = [_take_evaluation(m, asked) for m in replies]
            self._folded = self._aggregate_evaluation(
                server_round, evaluations, server_round - 1, report
            )
        candidates = [_unpack_train(m, asked) for m in replies]
        screen_replies(self.local_update, candidates)
        new, valid = self.run_rule(
            server_round, candidates, self._sent, self.weighted_by_key
        )
        if new is None:
            return None, None
        entry = self.round_reports[server_round]
        entry["diagnostics"].update(
            aggregate_replies(self.local_update, valid, self.weighted_by_key)
        )
        metrics = self.train_metrics_aggr_fn(
            [_metrics_content(c) for c in valid], self.weighted_by_key
        )
        for key in wire.PER_REPLY:  # who sent a reply: no average
            metrics.pop(key, None)
        entry["train"] = dict(metrics)
        if self.average_last_two and self._sent is not None:
            self._iterate, self._iterate_record = new, None
            output = _to_record(evaluation_average(self._sent, new))
        else:
            self._iterate = self._iterate_record = None
            output = _to_record(new)
        self._last_output = output
        return output, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure evaluation as Flower does (none with ``fraction_evaluate=0``)."""
        if self.fraction_evaluate == 0.0:
            return []
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        self._asked["evaluate"] = messages
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Screen evaluation replies, then aggregate their metrics as Flower does.

        They score the model of ``server_round`` (``model-round`` in
        ``round_reports[server_round]["federated_eval"]``).
        """
        entry = self.round_reports.setdefault(server_round, {})
        return self._evaluate_replies(server_round, replies, entry)

    def _evaluate_replies(
        self, server_round: int, replies: Iterable[Message], entry: dict[str, Any]
    ) -> MetricRecord | None:
        """Unpack an evaluate exchange's replies, then :meth:`_aggregate_evaluation`."""
        asked = _recipients(self._asked["evaluate"])
        candidates = [_unpack_evaluate(m, asked) for m in replies]
        return self._aggregate_evaluation(server_round, candidates, server_round, entry)

    def _aggregate_evaluation(
        self,
        server_round: int,
        candidates: list[EvaluateReply | str],
        model_round: int,
        entry: dict[str, Any],
    ) -> MetricRecord | None:
        """Screen evaluations of ``model_round``'s model and aggregate them.

        One path for evaluate replies and folded ones: the screen's counts
        go to ``entry["evaluate_replies"]``, Flower's weighted average with
        ``model-round`` to ``entry["federated_eval"]``.
        """
        label = f"Round {server_round} evaluate"
        valid, report = screen(candidates, None, self.weighted_by_key, label)
        entry["evaluate_replies"] = report.as_dict()
        if not valid:
            return None
        metrics = flwr_strategy.FedAvg.aggregate_evaluate(
            self, server_round, [c.source for c in valid]
        )
        if metrics is not None:
            entry["federated_eval"] = {**metrics, "model-round": model_round}
        return metrics

    @property
    def folds_evaluation(self) -> bool:
        """Whether federated evaluation rides on the train exchange (see class)."""
        return self.evaluate_with_train and self.fraction_evaluate > 0.0

    # --- the round loop ----------------------------------------------------------

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        should_stop: Callable[[int, Result], bool] | None = None,
        *,
        start_round: int | None = None,
    ) -> Result:
        """Run rounds ``start_round`` … ``num_rounds``; Flower's loop otherwise.

        The arguments and the loop are those of Flower's ``Strategy.start``
        (its nightly's, with ``should_stop(round, result) -> bool`` called
        after every round), plus:

        start_round : int | None (default: None)
            The first round to run: 1 for a new strategy, the saved round +
            1 after :meth:`load_state_records`. ``num_rounds`` is then the
            *last* round (resuming a 20-round run after round 8:
            ``start(..., num_rounds=20)`` runs rounds 9 … 20), and
            ``evaluate_fn`` sees ``initial_arrays`` as round
            ``start_round − 1``.

        The run also ends after a round where the stop rule (``stop_metric``
        & co.) fires; :attr:`stop_reason` says why (None: all rounds ran).
        With ``evaluate_with_train`` each round makes one exchange (its
        federated evaluation, of the previous round's model, rides on the
        train messages; the stop rule sees it in that round) and one
        evaluate exchange after the last round scores the final model
        (:attr:`final_evaluation`).
        ``Result.arrays`` is the model whose metrics were reported last
        (with ``average_last_two`` the average of the last two iterates).
        """
        if start_round is None:
            start_round = self._resume_round or 1
        self._resume_round = None
        if isinstance(start_round, bool) or not isinstance(start_round, int):
            raise ValueError(f"Invalid start_round: {start_round!r} (an int >= 1)")
        if start_round < 1 or num_rounds < start_round:
            raise ValueError(
                f"Invalid start_round {start_round} for num_rounds {num_rounds}: "
                "rounds start_round … num_rounds run (num_rounds is the last one)"
            )
        log(INFO, "Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(
            num_rounds - start_round + 1, initial_arrays, train_config, evaluate_config
        )
        self.summary()
        log(INFO, "")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result(arrays=initial_arrays)
        self.stop_reason = self.stop_message = None
        self.final_evaluation = None
        t_start = time.time()
        if evaluate_fn:
            res = evaluate_fn(start_round - 1, initial_arrays)
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[start_round - 1] = res
        arrays = initial_arrays
        last_round = start_round - 1
        for current_round in range(start_round, num_rounds + 1):
            last_round = current_round
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            arrays = self._one_round(
                current_round,
                arrays,
                result,
                grid,
                timeout,
                (train_config, evaluate_config),
                evaluate_fn,
            )
            # folded: this round's federated evaluation scored the last model
            scored = current_round - 1 if self.folds_evaluation else current_round
            for source, records, key in (
                (CENTRAL, result.evaluate_metrics_serverapp, current_round),
                (FEDERATED, result.evaluate_metrics_clientapp, scored),
                (TRAIN, result.train_metrics_clientapp, current_round),
            ):
                self._observe(current_round, source, records.get(key))
            rounds_left = current_round < num_rounds
            stop = self._decide_stop(current_round, rounds_left)
            if should_stop is not None and should_stop(current_round, result):
                if not stop and rounds_left:
                    self.stop_reason = "should-stop"
                    self.stop_message = (
                        f"should_stop returned True after round {current_round}"
                    )
                stop = True
            if stop:
                log(INFO, "Stopping early after round %s", current_round)
                break
        if self.folds_evaluation and last_round >= start_round:
            self._final_evaluation(
                last_round, arrays, result, grid, timeout, evaluate_config
            )
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        log(INFO, "")
        log(INFO, "Final results:")
        log(INFO, "")
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")
        return result

    def _one_round(
        self,
        current_round: int,
        arrays: ArrayRecord,
        result: Result,
        grid: Grid,
        timeout: float,
        configs: tuple[ConfigRecord, ConfigRecord],
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    ) -> ArrayRecord:
        """One round of Flower's loop: train, federated and central evaluation."""
        train_replies = grid.send_and_receive(
            messages=self.configure_train(current_round, arrays, configs[0], grid),
            timeout=timeout,
        )
        agg_arrays, agg_train_metrics = self.aggregate_train(
            current_round, train_replies
        )
        if agg_arrays is not None:
            result.arrays = agg_arrays
            arrays = agg_arrays
        if agg_train_metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_train_metrics)
            result.train_metrics_clientapp[current_round] = agg_train_metrics
        if self.folds_evaluation:  # came with the train replies: the sent model's
            folded, self._folded = self._folded, None
            if folded is not None:
                model_round = current_round - 1
                log(INFO, "\t└──> Round %s's model: %s", model_round, folded)
                result.evaluate_metrics_clientapp[current_round - 1] = folded
        else:
            messages = list(
                self.configure_evaluate(current_round, arrays, configs[1], grid)
            )
            evaluate_replies = (  # none to send (evaluation off): no exchange
                grid.send_and_receive(messages=messages, timeout=timeout)
                if messages
                else []
            )
            agg_evaluate_metrics = self.aggregate_evaluate(
                current_round, evaluate_replies
            )
            if agg_evaluate_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_evaluate_metrics)
                result.evaluate_metrics_clientapp[current_round] = agg_evaluate_metrics
        if evaluate_fn:
            log(INFO, "Global evaluation")
            res = evaluate_fn(current_round, arrays)
            log(INFO, "\t└──> MetricRecord: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[current_round] = res
        return arrays

    def _final_evaluation(
        self,
        last_round: int,
        arrays: ArrayRecord,
        result: Result,
        grid: Grid,
        timeout: float,
        config: ConfigRecord,
    ) -> None:
        """Score the final model in one evaluate exchange (folded runs).

        Sampled and aggregated as a separate evaluation of ``last_round``
        would be; the reports go to :attr:`final_evaluation`, not to the
        round's entry (recorded already, with the previous model's scores).
        """
        log(INFO, "")
        log(INFO, "[FINAL EVALUATION] of round %s's model", last_round)
        replies = grid.send_and_receive(
            messages=self.configure_evaluate(last_round, arrays, config, grid),
            timeout=timeout,
        )
        entry: dict[str, Any] = {}
        metrics = self._aggregate_final(last_round, replies, entry)
        self.final_evaluation = entry
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[last_round] = metrics

    def _aggregate_final(
        self, server_round: int, replies: Iterable[Message], entry: dict[str, Any]
    ) -> MetricRecord | None:
        """:meth:`aggregate_evaluate` of the final exchange, reported into ``entry``."""
        return self._evaluate_replies(server_round, replies, entry)

    # --- state -----------------------------------------------------------------

    def _iterate_state(self) -> tuple[Arrays, Arrays] | None:
        """Return (returned model, w_{t+1}) with ``average_last_two``, else None."""
        if self._iterate is None or self._last_output is None:
            return None
        return _to_numpy(self._last_output), self._iterate

    @property
    def latest_arrays(self) -> ArrayRecord | None:
        """The global model this strategy returned last (None before any)."""
        return self._last_output

    @property
    def training_arrays(self) -> ArrayRecord | None:
        """The model the next round trains from (None before any round)."""
        if self._iterate is None:
            return self._last_output
        if self._iterate_record is None:
            self._iterate_record = _to_record(self._iterate)
        return self._iterate_record
