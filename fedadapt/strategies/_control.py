"""Stop early, resume at round k, state in Flower's records: both adapters.

:class:`RunControl` sits between :class:`~fedadapt.strategies.adapter.RuleHost`
and Flower's FedAvg in both adapters. It owns

- the **stop rule** (``stop_metric`` & co.,
  :class:`~fedadapt.strategies.core.stopping.StopRule`): after each round
  the watched metric is looked up in the round's server-side evaluation,
  else its federated evaluation, else its train metrics; when the rule
  fires and rounds remain, the run ends and :attr:`RunControl.stop_reason`
  says why;
- the **state records** (:meth:`RunControl.state_to_records` /
  :meth:`RunControl.load_state_records`): the rule's moments, the last
  round, the stop rule's counters and, with ``average_last_two``, the
  iterate training continues from, as an ``ArrayRecord`` and
  ``ConfigRecord`` s a user keeps in ``context.state`` or on disk; a strategy that loads
  them continues at the next round exactly as the saved one would have.

With ``average_last_two`` the model a strategy returns (and Flower
evaluates, and a user saves) is (w_t + w_{t+1})/2; training continues from
w_{t+1}, which the strategy keeps. A resumed strategy recognises the
returned model by its digest and trains from the kept w_{t+1} again.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any, TypedDict

from flwr.app import RecordDict
from flwr.common.logger import log

from fedadapt.strategies._records import (
    arrays_digest,
    state_from_records,
    state_to_records,
)
from fedadapt.strategies.core import Arrays, ServerRule
from fedadapt.strategies.core.robust import AggregatorState
from fedadapt.strategies.core.stopping import StopRule, find_metric

if TYPE_CHECKING:
    from fedadapt.strategies.local_update import LocalUpdate

#: Name of the records :meth:`RunControl.state_to_records` writes
#: (``fedadapt-strategy.arrays`` / ``.values`` / ``.layout``).
STATE_NAME = "fedadapt-strategy"

#: Where the stop rule looks for its metric, first match wins.
CENTRAL, FEDERATED, TRAIN = 0, 1, 2


class StopKwargs(TypedDict, total=False):
    """The stop rule's arguments, taken by every strategy (see :class:`RunControl`)."""

    stop_metric: str | None
    stop_mode: str
    stop_target: float | None
    stop_patience: int
    stop_min_delta: float


class RunControl:
    """Stop rule, resume round and state records shared by both adapters.

    Parameters
    ----------
    stop_metric : str | None (default: None)
        Metric watched by the stop rule (None: never stop early). Looked up
        per round in the server-side evaluation (``evaluate_fn``), then the
        aggregated federated evaluation, then the aggregated train metrics;
        rounds without it do not count.
    stop_mode : str (default: "max")
        ``"max"`` (accuracy: larger is better) or ``"min"`` (loss).
    stop_target : float | None (default: None)
        Stop once the metric reaches this value.
    stop_patience : int (default: 0)
        Stop after this many evaluations of the metric in a row without
        improvement (by more than ``stop_min_delta``); 0 = never.
    stop_min_delta : float (default: 0.0)
        Smallest change that counts as an improvement.

    Attributes
    ----------
    stop_rule : StopRule | None
        The rule (None without ``stop_metric``).
    stop_reason : str | None
        ``"stop-target"`` or ``"stop-patience"`` when the last run ended
        early by the stop rule, ``"should-stop"`` by ``start``'s
        ``should_stop`` (Message API); None when it ran all its rounds.
    stop_message : str | None
        The same, as a sentence.
    completed_round : int
        The last round this strategy aggregated (0 before any).
    """

    rule: ServerRule
    local_update: LocalUpdate | None
    aggregator_state: AggregatorState

    def __init__(
        self,
        *args: Any,
        stop_metric: str | None = None,
        stop_mode: str = "max",
        stop_target: float | None = None,
        stop_patience: int = 0,
        stop_min_delta: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if stop_metric is None and (stop_target is not None or stop_patience):
            raise ValueError("stop_target and stop_patience need a stop_metric")
        self.stop_rule: StopRule | None = None
        if stop_metric is not None:
            self.stop_rule = StopRule(
                stop_metric,
                mode=stop_mode,
                target=stop_target,
                patience=stop_patience,
                min_delta=stop_min_delta,
            )
        super().__init__(*args, **kwargs)
        self.stop_reason: str | None = None
        self.stop_message: str | None = None
        self.completed_round = 0
        # (round, source, value) of the watched metric not yet decided on
        self._stop_seen: tuple[int, int, float] | None = None
        self._stop_metric_missed = False  # warned once that a round lacked it
        # after load_state_records: the round to start at, and the digest of
        # the returned model with the iterate to train from instead of it
        self._resume_round: int | None = None
        self._resume_model: tuple[str, Arrays] | None = None

    # --- the stop rule ---------------------------------------------------------

    def _observe(self, server_round: int, source: int, metrics: Any) -> None:
        """Note the watched metric of ``server_round`` from ``source`` (if there)."""
        if self.stop_rule is None or metrics is None:
            return
        value = find_metric(self.stop_rule.metric, metrics)
        seen = self._stop_seen
        if value is not None and (
            seen is None or seen[0] != server_round or source < seen[1]
        ):
            self._stop_seen = (server_round, source, value)

    def _decide_stop(self, server_round: int, rounds_left: bool) -> bool:
        """Feed round ``server_round``'s metric to the rule; True: stop now.

        The rule counts every round that reported the metric; the run ends
        (and :attr:`stop_reason` is set) only when rounds remain.
        """
        seen, self._stop_seen = self._stop_seen, None
        if self.stop_rule is None:
            return False
        if seen is None or seen[0] != server_round:
            if not self._stop_metric_missed:
                self._stop_metric_missed = True
                log(
                    WARNING,
                    "fedadapt: stop metric %r was not reported in round "
                    "%s; rounds without it do not count for the stop rule",
                    self.stop_rule.metric,
                    server_round,
                )
            return False
        reason = self.stop_rule.update(server_round, seen[2])
        if reason is None or not rounds_left:
            return False
        self.stop_reason, self.stop_message = reason, self.stop_rule.message
        log(
            INFO,
            "fedadapt: stopping after round %s: %s",
            server_round,
            self.stop_message,
        )
        return True

    # --- resume ------------------------------------------------------------------

    def _iterate_state(self) -> tuple[Arrays, Arrays] | None:
        """Adapter hook: (returned model, training iterate) when they differ."""
        return None

    def _model_state(self) -> dict[str, Any] | None:
        """Digest of the returned model and the iterate training continues from."""
        pair = self._iterate_state()
        if pair is not None:
            return {"output": arrays_digest(pair[0]), "iterate": pair[1]}
        if self._resume_model is not None:  # loaded, not trained since
            return {"output": self._resume_model[0], "iterate": self._resume_model[1]}
        return None

    def _resumed_iterate(self, given: Arrays) -> Arrays | None:
        """Return the kept iterate when ``given`` is the model saved with the state.

        Called by the adapters for the first model they are asked to train
        after :meth:`load_state_records`. None: train from ``given``
        (logged when it is neither the returned model nor the iterate).
        """
        pending, self._resume_model = self._resume_model, None
        if pending is None:
            return None
        digest, iterate = pending
        found = arrays_digest(given)
        if found == digest:
            return iterate
        if found != arrays_digest(iterate):
            log(
                WARNING,
                "fedadapt: the arrays to train from are not the model "
                "saved with the loaded strategy state; training continues from "
                "them, not from the saved iterate",
            )
        return None

    def state_to_records(self) -> RecordDict:
        """Return the strategy's state as Flower records (a ``RecordDict``).

        ``fedadapt-strategy.arrays`` (ArrayRecord: the rule's moments and,
        with ``average_last_two``, the iterate w_{t+1}),
        ``fedadapt-strategy.values`` (ConfigRecord: step count, last round,
        the stop rule's counters; the legacy strategy's SecAgg+ bound,
        weight cap and quarantine) and ``fedadapt-strategy.layout``. Keep
        them in ``context.state`` (``context.state.update(...)``) or write
        :func:`fedadapt.strategies.records_to_bytes` to a file.
        """
        state = {
            "rule": self.rule.state_dict(),
            "round": self.completed_round,
            "stop": None if self.stop_rule is None else self.stop_rule.state_dict(),
            "model": self._model_state(),
        }
        if self.local_update is not None:
            state["local_update"] = self.local_update.state_dict()
        aggregator = self.aggregator_state.state_dict()
        if aggregator:  # centered clipping's centre
            state["aggregator"] = aggregator
        host = self._host_state()
        if host:  # the legacy strategy's SecAgg+ state
            state["host"] = host
        return state_to_records(state, STATE_NAME)

    def _host_state(self) -> dict[str, Any]:
        """Adapter hook: its own state to keep with the rule's (none here)."""
        return {}

    def _load_host_state(self, state: Mapping[str, Any]) -> None:
        """Adapter hook: restore :meth:`_host_state` (``{}``: none was kept)."""

    def load_state_records(self, records: RecordDict) -> None:
        """Restore :meth:`state_to_records` output (before ``start``).

        The next run starts at the saved round + 1 (Message API: ``start``
        without ``start_round``; legacy API: Flower's rounds up to the saved
        one do nothing). Give it the model the saved strategy returned
        (``Result.arrays``, or what you saved of it) as the initial arrays.
        """
        state = state_from_records(records, STATE_NAME)
        self.rule.load_state_dict(state["rule"])
        if self.local_update is not None and "local_update" in state:
            self.local_update.load_state_dict(state["local_update"])
        self.aggregator_state.load_state_dict(state.get("aggregator") or {})
        self._load_host_state(state.get("host") or {})
        if self.stop_rule is not None and state["stop"] is not None:
            self.stop_rule.load_state_dict(state["stop"])
        self.completed_round = int(state["round"])
        self._resume_round = self.completed_round + 1
        model = state["model"]
        self._resume_model = (
            None if model is None else (str(model["output"]), dict(model["iterate"]))
        )
