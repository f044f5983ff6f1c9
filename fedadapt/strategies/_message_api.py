"""Thin Message-API adapter: Flower samples and configures, the core rule updates.

:class:`RuleStrategy` is a mixin placed before a ``flwr.serverapp.strategy``
class in the bases. Sampling, configuration, metric aggregation and the round
loop (``start``) stay Flower's; only ``aggregate_train`` is replaced by
screening + a :class:`~fedadapt.strategies.core.ServerRule`. Optionally the
sampling is made reproducible (``sampling_seed``, ``node_keys``).
"""

from __future__ import annotations

import io
import random
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from logging import WARNING
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import SType
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from fedadapt.strategies._screening import (
    Candidate,
    LazyArrays,
    RuleHost,
    ScreeningKwargs,
    evaluation_average,
    screen,
)
from fedadapt.strategies.core import Arrays


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


def _unpack(message: Message, with_arrays: bool) -> Candidate | str:
    node = message.metadata.src_node_id
    if message.has_error():
        return message.error.reason or f"error code {message.error.code}"
    content = message.content
    if len(content.metric_records) != 1:
        return Candidate(node, None, {}, message, "expected exactly one MetricRecord")
    metrics = dict(next(iter(content.metric_records.values())))
    if not with_arrays:
        return Candidate(node, None, metrics, message)
    if len(content.array_records) != 1:
        return Candidate(node, None, metrics, message, "expected one ArrayRecord")
    arrays = LazyArrays(next(iter(content.array_records.values())))
    return Candidate(node, arrays, metrics, message)


class _NodeSnapshot:
    """A Grid whose ``get_node_ids`` returns a fixed list (one round's sample)."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid, self._node_ids = grid, node_ids

    def get_node_ids(self) -> list[int]:
        """Return the snapshot taken when the round was configured."""
        return list(self._node_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def _snapshot(grid: Grid, node_ids: list[int]) -> Grid:
    """Return a :class:`_NodeSnapshot` as what it stands in for (duck-typed)."""
    return cast(Grid, _NodeSnapshot(grid, node_ids))


class RuleStrategy(RuleHost):
    """Mixin: screen replies, apply ``self.rule``, keep per-round reports.

    See :class:`~fedadapt.strategies._screening.RuleHost` for ``rule``,
    ``average_last_two`` and ``round_reports``.

    Attributes
    ----------
    round_offset : int
        Added to Flower's round counter (set when resuming from a checkpoint,
        so clients and reports see the global round number).
    """

    weighted_by_key: str
    arrayrecord_key: str
    min_available_nodes: int
    train_metrics_aggr_fn: Callable[..., MetricRecord]

    #: Node loss: seconds to wait for missing nodes before a round samples
    #: from the nodes still connected. None (default) keeps Flower's
    #: behaviour of waiting for ``min_available_nodes`` indefinitely.
    node_grace_s: float | None = None

    #: Reproducible sampling: with a seed, each round's sample is a function
    #: of (seed, phase, global round) and of the connected nodes' keys only
    #: (see :meth:`_sampling_grid`). None (default): Flower's unseeded RNG.
    sampling_seed: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.round_offset = 0
        #: node id -> stable key (the ServerApp puts each node's partition-id
        #: here); orders nodes for seeded sampling and replies for aggregation
        self.node_keys: dict[int, int] = {}
        self._degraded: dict[str, int] = {}  # phase minimum -> nodes after a loss
        self._sent: Arrays | None = None
        self._last_output: ArrayRecord | None = None
        self._evaluation: ArrayRecord | None = None
        self._evaluation_pair: tuple[Arrays, Arrays] | None = None

    # --- Flower hooks ------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global arrays, then sample and configure as Flower does."""
        with self._sampling_grid(grid, server_round, "min_train_nodes") as g:
            messages = list(
                super().configure_train(  # type: ignore[misc]
                    server_round + self.round_offset, arrays, config, g
                )
            )
        self._record_sample(server_round, "train", messages)
        # Flower's FedOpt already keeps a NumPy copy; reuse it instead of a second
        kept = getattr(self, "current_arrays", None)
        self._sent = kept if isinstance(kept, dict) else _to_numpy(arrays)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen replies, apply the rule; ``(None, None)`` keeps the model."""
        server_round += self.round_offset
        # partition order, not arrival order: breaks the ties of canonical_order
        # (equal weights), so float sums do not depend on arrival
        candidates = [
            _unpack(m, with_arrays=True) for m in self._in_node_order(replies)
        ]
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
        if getattr(self, "fraction_evaluate", 0.0) == 0.0:
            return []
        with self._sampling_grid(grid, server_round, "min_evaluate_nodes") as g:
            messages = list(
                super().configure_evaluate(  # type: ignore[misc]
                    server_round + self.round_offset,
                    self.evaluation_arrays(arrays),
                    config,
                    g,
                )
            )
        self._record_sample(server_round, "evaluate", messages)
        return messages

    # --- sampling ----------------------------------------------------------------

    def _node_order(self, node_id: int) -> tuple[int, int]:
        """Sort key of a node: its key (partition-id) first, unknown nodes last."""
        key = self.node_keys.get(node_id)
        return (0, key) if key is not None else (1, node_id)

    def _in_node_order(self, replies: Iterable[Message]) -> list[Message]:
        return sorted(replies, key=lambda m: self._node_order(m.metadata.src_node_id))

    def _record_sample(
        self, server_round: int, phase: str, messages: list[Message]
    ) -> None:
        """Record which nodes (by key where known) were sampled in ``phase``."""
        if not self.node_keys:
            return
        sampled = sorted(
            self.node_keys.get(m.metadata.dst_node_id, m.metadata.dst_node_id)
            for m in messages
        )
        entry = self.round_reports.setdefault(server_round + self.round_offset, {})
        entry.setdefault("sampled", {})[phase] = sampled

    @contextmanager
    def _sampling_grid(
        self, grid: Grid, server_round: int, minimum: str
    ) -> Iterator[Grid]:
        """Yield the grid Flower samples from: connected nodes, seeded if asked.

        Flower draws ``random.sample(grid.get_node_ids(), k)`` with the
        module-level RNG, unseeded, over node ids that are random per run, so
        two runs with the same seed train different clients. With
        ``sampling_seed`` set, the nodes are listed in a stable order (by
        ``node_keys``, i.e. partition-id) and the draw runs under
        ``random.seed("fedadapt/<seed>/<phase>/<global round>")``; the RNG's
        previous state is restored afterwards, so nobody else's random
        numbers change. The sample then depends only on the seed, the round,
        the phase and which partitions are connected, also after a resume
        from a checkpoint.
        """
        with self._connected_nodes_only(grid, server_round, minimum) as connected:
            if self.sampling_seed is None:
                yield connected
                return
            nodes = sorted(connected.get_node_ids(), key=self._node_order)
            wanted = max(self.min_available_nodes, getattr(self, minimum))
            if len(nodes) < wanted:  # Flower must keep waiting for nodes
                yield connected
                return
            phase = "train" if minimum == "min_train_nodes" else "evaluate"
            global_round = server_round + self.round_offset
            saved = random.getstate()
            random.seed(f"fedadapt/{self.sampling_seed}/{phase}/{global_round}")
            try:
                yield _snapshot(connected, nodes)
            finally:
                random.setstate(saved)

    @contextmanager
    def _connected_nodes_only(
        self, grid: Grid, server_round: int, minimum: str
    ) -> Iterator[Grid]:
        """Yield the grid to sample from, lowering the minimums after node loss.

        Flower's sampling waits until ``min_available_nodes`` (and the
        ``minimum`` of this phase) are connected — forever, once a node is
        gone. With ``node_grace_s`` set, missing nodes get that long to come
        back (once per loss: a round that finds the same reduced set goes on
        at once); then the round samples from the nodes still connected (at
        least one), logs a warning and records ``nodes`` (wanted / connected)
        in ``round_reports``. Sampling sees one snapshot of the connected
        nodes, so a node lost meanwhile cannot make Flower wait forever (its
        message comes back as a failed reply). The minimums are restored
        afterwards: nodes that return are sampled again.
        """
        if self.node_grace_s is None:
            yield grid
            return
        wanted = max(self.min_available_nodes, getattr(self, minimum))
        nodes = list(grid.get_node_ids())
        if len(nodes) < wanted and len(nodes) < self._degraded.get(minimum, wanted):
            deadline = time.monotonic() + self.node_grace_s  # a new loss: wait
            while len(nodes) < wanted and time.monotonic() < deadline:
                time.sleep(min(1.0, self.node_grace_s))
                nodes = list(grid.get_node_ids())
        if len(nodes) >= wanted:
            self._degraded.pop(minimum, None)
            yield _snapshot(grid, nodes)
            return
        if not nodes:
            yield grid  # nobody left: Flower waits for nodes to (re)connect
            return
        self._degraded[minimum] = len(nodes)
        phase = "train" if minimum == "min_train_nodes" else "evaluate"
        log(WARNING, "Round %s %s: %d of %d nodes connected; sampling from those",
            server_round + self.round_offset, phase, len(nodes), wanted)  # fmt: skip
        entry = self.round_reports.setdefault(server_round + self.round_offset, {})
        entry.setdefault("nodes", {})[phase] = {
            "wanted": wanted,
            "connected": len(nodes),
        }
        saved = self.min_available_nodes, getattr(self, minimum)
        self.min_available_nodes = len(nodes)
        setattr(self, minimum, min(saved[1], len(nodes)))
        try:
            yield _snapshot(grid, nodes)
        finally:
            self.min_available_nodes = saved[0]
            setattr(self, minimum, saved[1])

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Screen evaluation replies, then aggregate their metrics as Flower does."""
        server_round += self.round_offset
        candidates = [
            _unpack(m, with_arrays=False) for m in self._in_node_order(replies)
        ]
        valid, report = screen(
            candidates, None, self.weighted_by_key, f"Round {server_round} evaluate"
        )
        entry = self.round_reports.setdefault(server_round, {})
        entry["evaluate_replies"] = report.as_dict()
        if not valid:
            return None
        metrics = super().aggregate_evaluate(  # type: ignore[misc]
            server_round, [c.source for c in valid]
        )
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
        """Run Flower's round loop.

        ``evaluate_fn`` sees the evaluation model and the global round number
        (``round_offset`` added).
        """
        wrapped = None
        if evaluate_fn is not None:

            def wrapped(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                return evaluate_fn(
                    server_round + self.round_offset, self.evaluation_arrays(arrays)
                )

        return super().start(  # type: ignore[misc]
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
