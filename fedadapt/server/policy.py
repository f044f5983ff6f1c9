"""The strategy a fedadapt run uses: a library strategy plus the run's policies.

:class:`RunStrategy` is :class:`fedadapt.strategies.RuleStrategy` (Flower's
FedAvg with a fedadapt rule) plus what only a run needs, kept out of the
strategies a plug-in user imports (:class:`LegacyRunStrategy` is the same
for the legacy API, with reproducible sampling only):

- **reproducible sampling** (``sampling_seed``, ``node_keys``): the same
  clients train in the same rounds across runs and resumes;
- **node grace** (``node_grace_s``): after node loss, rounds go on with the
  nodes still connected instead of waiting forever;
- **resume offset** (``round_offset``): after a resume from a checkpoint
  the strategy, its clients and its reports see global round numbers,
  while Flower's loop counts from 1 again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from logging import INFO, WARNING
from typing import Any, Unpack, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    Parameters,
    Scalar,
)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.criterion import Criterion
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedadapt.server.partition_query import Answer, NoAnswer, query_partition_ids
from fedadapt.strategies import RuleStrategy
from fedadapt.strategies._message_api import FedAvgKwargs
from fedadapt.strategies.core import ServerRule
from fedadapt.strategies.legacy import LegacyFedAvgKwargs, LegacyRuleStrategy


@contextmanager
def seeded_draw(seed: int, phase: str, global_round: int) -> Iterator[None]:
    """Run the block under ``random.seed("fedadapt/<seed>/<phase>/<round>")``.

    Flower's samplers (both APIs) draw with ``random.sample`` from the
    module-level RNG; seeding it here makes the draw a function of the seed,
    the phase (``train`` / ``evaluate``) and the global round. The RNG's
    previous state is restored afterwards, so nobody else's random numbers
    change.
    """
    saved = random.getstate()
    random.seed(f"fedadapt/{seed}/{phase}/{global_round}")
    try:
        yield
    finally:
        random.setstate(saved)


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


class RunStrategy(RuleStrategy):
    """A :class:`~fedadapt.strategies.RuleStrategy` with a run's policies.

    Parameters
    ----------
    rule : ServerRule
        The update rule.
    sampling_seed : int | None (default: None)
        With a seed, each round's sample is a function of (seed, phase,
        global round) and of the connected nodes' keys only (see
        :meth:`_sampling_grid`). None: Flower's unseeded RNG.
    node_keys : dict[int, int] | None (default: None)
        Node id -> stable key (the ServerApp puts each node's partition-id
        here): orders nodes for seeded sampling and replies for
        aggregation (so float sums do not depend on arrival order).
    node_grace_s : float | None (default: None)
        Node loss: seconds to wait for missing nodes before a round samples
        from the nodes still connected. None keeps Flower's behaviour of
        waiting for ``min_available_nodes`` indefinitely.
    round_offset : int (default: 0)
        Added to Flower's round counter (set when resuming from a
        checkpoint, so the rule, the clients and the reports see the global
        round number).
    **kwargs
        As :class:`~fedadapt.strategies.RuleStrategy`.
    """

    def __init__(
        self,
        rule: ServerRule,
        *,
        sampling_seed: int | None = None,
        node_keys: dict[int, int] | None = None,
        node_grace_s: float | None = None,
        round_offset: int = 0,
        average_last_two: bool = False,
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
        self.sampling_seed = sampling_seed
        self.node_keys: dict[int, int] = dict(node_keys or {})
        self.node_grace_s = node_grace_s
        self.round_offset = round_offset
        self._degraded: dict[str, int] = {}  # phase minimum -> nodes after a loss

    # --- Flower hooks: global round numbers, policies around the library's ------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample (seeded, from connected nodes) and configure the global round."""
        with self._sampling_grid(grid, server_round, "min_train_nodes") as g:
            messages = list(
                super().configure_train(
                    server_round + self.round_offset, arrays, config, g
                )
            )
        self._record_sample(server_round, "train", messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the global round, replies in node-key order."""
        return super().aggregate_train(
            server_round + self.round_offset, self._in_node_order(replies)
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample (seeded, from connected nodes) the global round's evaluation."""
        if self.fraction_evaluate == 0.0:
            return []
        with self._sampling_grid(grid, server_round, "min_evaluate_nodes") as g:
            messages = list(
                super().configure_evaluate(
                    server_round + self.round_offset, arrays, config, g
                )
            )
        self._record_sample(server_round, "evaluate", messages)
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate the global round's evaluation, replies in node-key order."""
        return super().aggregate_evaluate(
            server_round + self.round_offset, self._in_node_order(replies)
        )

    def _aggregate_final(
        self, server_round: int, replies: Iterable[Message], entry: dict[str, Any]
    ) -> MetricRecord | None:
        """Aggregate the final evaluation of the global round, in node-key order."""
        return super()._aggregate_final(
            server_round + self.round_offset, self._in_node_order(replies), entry
        )

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
        """Run the loop; ``evaluate_fn`` sees the global round number."""
        shifted = None
        if evaluate_fn is not None:

            def shifted(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                return evaluate_fn(server_round + self.round_offset, arrays)

        return super().start(
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            train_config,
            evaluate_config,
            shifted,
            should_stop,
            start_round=start_round,
        )

    def _observe(self, server_round: int, source: int, metrics: Any) -> None:
        """Note the stop rule's metric under the global round number."""
        super()._observe(server_round + self.round_offset, source, metrics)

    def _decide_stop(self, server_round: int, rounds_left: bool) -> bool:
        """Decide the stop rule on the global round."""
        return super()._decide_stop(server_round + self.round_offset, rounds_left)

    # --- node order and sampling -------------------------------------------------

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
        :func:`seeded_draw`. The sample then depends only on the seed, the
        round, the phase and which partitions are connected, also after a
        resume from a checkpoint.
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
            with seeded_draw(self.sampling_seed, phase, global_round):
                yield _snapshot(connected, nodes)

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
        log(
            WARNING,
            "Round %s %s: %d of %d nodes connected; sampling from those",
            server_round + self.round_offset,
            phase,
            len(nodes),
            wanted,
        )
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


# --- the legacy API ---------------------------------------------------------------


class _SeededPool(ClientManager):
    """A view of Flower's client manager whose :meth:`sample` is reproducible.

    Everything but sampling goes to the real manager. :meth:`sample` is
    Flower's ``SimpleClientManager.sample`` with the clients listed by
    partition-id (asked once per client) instead of registration order, and
    the draw under :func:`seeded_draw` — the same list order and the same
    ``random.sample`` call as the Message API's seeded sampling, so both
    APIs train the same partitions for the same seed.
    """

    def __init__(
        self, manager: ClientManager, owner: LegacyRunStrategy, phase: str, rnd: int
    ) -> None:
        self._manager, self._owner = manager, owner
        self._phase, self._round = phase, rnd

    def num_available(self) -> int:
        """As the real manager."""
        return self._manager.num_available()

    def register(self, client: ClientProxy) -> bool:
        """As the real manager."""
        return self._manager.register(client)

    def unregister(self, client: ClientProxy) -> None:
        """As the real manager."""
        self._manager.unregister(client)

    def all(self) -> dict[str, ClientProxy]:
        """As the real manager."""
        return self._manager.all()

    def wait_for(self, num_clients: int, timeout: int = 86400) -> bool:
        """As the real manager."""
        return self._manager.wait_for(num_clients, timeout)

    def sample(
        self,
        num_clients: int,
        min_num_clients: int | None = None,
        criterion: Criterion | None = None,
    ) -> list[ClientProxy]:
        """Sample ``num_clients`` reproducibly (Flower's waiting and limits)."""
        self.wait_for(num_clients if min_num_clients is None else min_num_clients)
        clients = list(self.all().values())
        if criterion is not None:
            clients = [c for c in clients if criterion.select(c)]
        if num_clients > len(clients):
            log(
                INFO,
                "Sampling failed: number of available clients (%s) is less "
                "than number of requested clients (%s).",
                len(clients),
                num_clients,
            )
            return []
        if num_clients < len(clients):  # a real sample: order by partition-id
            self._owner.learn_partitions(clients, self._round)
        clients.sort(key=self._owner.client_order)
        assert self._owner.sampling_seed is not None
        with seeded_draw(self._owner.sampling_seed, self._phase, self._round):
            return random.sample(clients, num_clients)


class LegacyRunStrategy(LegacyRuleStrategy):
    """A :class:`~fedadapt.strategies.legacy.LegacyRuleStrategy` with seeded sampling.

    The legacy ServerApp's counterpart of :class:`RunStrategy` (without node
    grace and resume, which the legacy loop does not support): with a
    ``sampling_seed`` each round's sample depends only on the seed, the
    phase, the round and the connected partitions — the same partitions as
    the Message API for the same seed. Clients are asked their
    ``partition-id`` once (``get_properties``; see
    :class:`fedadapt.client.numpy_client.FedAdaptClient`), the first time a
    round really samples; replies are aggregated in partition order, so the
    float sums do not depend on arrival order.

    Parameters
    ----------
    rule : ServerRule
        The update rule.
    sampling_seed : int | None (default: None)
        The seed of the draws; None: Flower's unseeded sampling.
    query_timeout : float (default: 3600.0)
        Seconds all attempts of the partition-id query may take together
        (the legacy app passes ``round-timeout``): a client that has not
        answered is asked again until then, and then the run fails
        (:mod:`fedadapt.server.partition_query`), never samples without it.
    average_last_two : bool (default: False)
        As :class:`~fedadapt.strategies.legacy.LegacyRuleStrategy`.
    **kwargs
        As :class:`~fedadapt.strategies.legacy.LegacyRuleStrategy`.
    """

    def __init__(
        self,
        rule: ServerRule,
        *,
        sampling_seed: int | None = None,
        query_timeout: float = 3600.0,
        average_last_two: bool = False,
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
        self.sampling_seed = sampling_seed
        self.query_timeout = query_timeout
        self.partitions: dict[str, int] = {}  # cid -> partition-id
        self._asked: set[str] = set()

    def client_order(self, client: ClientProxy) -> tuple[int, int | str]:
        """Sort key of a client: its partition-id first, unknown clients last."""
        pid = self.partitions.get(client.cid)
        return (0, pid) if pid is not None else (1, client.cid)

    def learn_partitions(self, clients: list[ClientProxy], server_round: int) -> None:
        """Ask the clients not asked before their partition-id, all at once.

        Clients that have not answered are asked again until they do, or
        :class:`~fedadapt.errors.PartitionQueryError` ends the run after
        ``query_timeout`` s (:func:`~fedadapt.server.partition_query.collect_answers`).
        A legacy proxy reports no error code, so a ``get_properties`` that
        raises counts as no answer (asked again), whatever the cause.
        """
        new = {c.cid: c for c in clients if c.cid not in self._asked}
        if not new:
            return

        def ask_one(client: ClientProxy, wait: float) -> Answer:
            try:
                ins = GetPropertiesIns(config={})
                return client.get_properties(ins, wait, server_round).properties
            except Exception as error:  # noqa: BLE001 - asked again
                return NoAnswer(f"{type(error).__name__}: {error}")

        def ask(cids: list[str], wait: float) -> dict[str, Answer]:
            with ThreadPoolExecutor(max_workers=min(32, len(cids))) as pool:
                replies = pool.map(lambda cid: ask_one(new[cid], wait), cids)
                return dict(zip(cids, replies, strict=True))

        keys = query_partition_ids(lambda: list(new), ask, self.query_timeout)
        self._asked.update(new)
        self.partitions.update(keys)

    def _pool(self, manager: ClientManager, phase: str, rnd: int) -> ClientManager:
        return (
            manager
            if self.sampling_seed is None
            else _SeededPool(manager, self, phase, rnd)
        )

    def _record_sample(self, server_round: int, phase: str, clients: list) -> None:
        """Record which partitions (cids where unknown) were sampled."""
        if not self.partitions:
            return
        sampled = [self.partitions.get(c.cid, c.cid) for c, _ in clients]
        sampled.sort(key=lambda v: (isinstance(v, str), v))
        entry = self.round_reports.setdefault(server_round, {})
        entry.setdefault("sampled", {})[phase] = sampled

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Sample (seeded) and configure the round's training."""
        pool = self._pool(client_manager, "train", server_round)
        pairs = super().configure_fit(server_round, parameters, pool)
        self._record_sample(server_round, "train", pairs)
        return pairs

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Sample (seeded) and configure the round's federated evaluation."""
        pool = self._pool(client_manager, "evaluate", server_round)
        pairs = super().configure_evaluate(server_round, parameters, pool)
        self._record_sample(server_round, "evaluate", pairs)
        return pairs

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Aggregate the replies in partition order."""
        ordered = sorted(results, key=lambda pair: self.client_order(pair[0]))
        return super().aggregate_fit(server_round, ordered, failures)

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """Aggregate the evaluation replies in partition order."""
        ordered = sorted(results, key=lambda pair: self.client_order(pair[0]))
        return super().aggregate_evaluate(server_round, ordered, failures)
