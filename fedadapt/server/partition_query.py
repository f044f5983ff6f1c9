"""The partition-id query of seeded sampling, Flower-free (both APIs share it).

Seeded sampling lists the nodes by ``partition-id`` before each seeded draw
(:mod:`fedadapt.server.policy`). A node whose partition-id is unknown would
sort by its node id, which is random per run, so the sample — and the model
— would depend on how fast the nodes answered. On a loaded machine a fixed
query timeout did exactly that: two runs with the same seed trained
different clients. So the query here never gives up silently:

- a node that has not answered (no reply yet, its message or reply expired,
  node unavailable, a legacy proxy that raised) is asked again, with a wait
  that doubles each attempt (from :data:`QUERY_ATTEMPT_S`), until every
  connected node answered or the run's ``round-timeout`` is spent; then
  :class:`~fedadapt.errors.PartitionQueryError` names the nodes that did not
  answer and the key to raise;
- a node that answers with a ``partition-id`` that is not an integer, or
  whose ClientApp fails on the query (:class:`Refused`), fails the run at
  once (:class:`~fedadapt.errors.PartitionQueryError`, key
  ``seeded-sampling``): asking again would not change its answer;
- a node that answers without a ``partition-id`` (a SuperNode with only its
  own ``data-path``) is a configuration, not a race: it is kept, logged and
  counted, and sorts after the numbered nodes (docs/deployment.md).

The API-specific part is the ``ask`` callable: the Message-API ServerApp
pushes ``query`` messages and pulls their replies
(:func:`fedadapt.server.server_app.node_partitions`), the legacy strategy
calls ``get_properties`` (:class:`fedadapt.server.policy.LegacyRunStrategy`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fedadapt.errors import PartitionQueryError
from fedadapt.strategies import wire

K = TypeVar("K", bound=Hashable)

#: Seconds the first attempt of the partition-id query waits for answers;
#: each further attempt waits twice as long, all within ``round-timeout``.
QUERY_ATTEMPT_S = 60.0

#: Shortest time between two attempts, so nodes that fail fast (an expired
#: message, an unavailable node) are not asked in a busy loop.
QUERY_PAUSE_S = 0.5

#: Nodes named in one log line or error message at most (then "and N more").
SHOWN_NODES = 8

LOGGER = logging.getLogger("flwr")  # Flower's logger: the run's own log


@dataclass(frozen=True)
class NoAnswer:
    """A node has not answered (yet): it is asked again while time is left."""

    reason: str = "no reply"


@dataclass(frozen=True)
class Refused:
    """A node answered with an error (its ClientApp failed on the query)."""

    reason: str


#: What ``ask`` returns for one node: the properties it reported, or why not.
Answer = Mapping[str, Any] | NoAnswer | Refused


def show(nodes: Iterable[Hashable]) -> str:
    """``nodes`` as a short comma-separated list for a message."""
    names = [str(n) for n in nodes]
    head = ", ".join(names[:SHOWN_NODES])
    more = len(names) - SHOWN_NODES
    return head + (f" and {more} more" if more > 0 else "")


def collect_answers(
    nodes: Callable[[], Iterable[K]],
    ask: Callable[[list[K], float], Mapping[K, Answer]],
    deadline_s: float,
    *,
    attempt_s: float | None = None,
    pause_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[K, Mapping[str, Any]]:
    """Ask ``nodes()`` until each has answered; return node -> its properties.

    Parameters
    ----------
    nodes : Callable[[], Iterable[K]]
        The connected nodes, listed again before each attempt: a node that
        connects meanwhile is asked too, one that left is no longer waited
        for (it is not sampled while it is gone).
    ask : Callable[[list[K], float], Mapping[K, Answer]]
        Asks the given nodes, waiting at most the given seconds; a node
        missing from the result has not answered.
    deadline_s : float
        Seconds all attempts together may take (the run's ``round-timeout``).
    attempt_s, pause_s : float | None
        The first attempt's wait (doubling each attempt) and the shortest
        time between attempts; None: :data:`QUERY_ATTEMPT_S`,
        :data:`QUERY_PAUSE_S` (read at call time).
    clock, sleep
        Time source and sleep (tests replace them).

    Raises
    ------
    PartitionQueryError
        A node refused (key ``seeded-sampling``), or nodes still connected
        had not answered after ``deadline_s`` (key ``round-timeout``).
    """
    wait = QUERY_ATTEMPT_S if attempt_s is None else attempt_s
    pause = QUERY_PAUSE_S if pause_s is None else pause_s
    start = clock()
    answers: dict[K, Mapping[str, Any]] = {}
    reasons: dict[K, str] = {}
    attempt = 0
    while True:
        pending = [n for n in nodes() if n not in answers]
        left = start + deadline_s - clock()
        if not pending:
            break
        if attempt and left <= 0:
            raise PartitionQueryError(
                "round-timeout",
                [str(n) for n in pending],
                f"seeded sampling: {len(pending)} node(s) did not report their "
                f"partition-id within {deadline_s:g}s ({attempt} attempts): "
                f"{_with_reasons(pending, reasons)}. Sampling without them "
                "would train other clients than a rerun with the same seed; "
                "raise round-timeout, check those nodes, or set "
                "seeded-sampling=false",
            )
        attempt += 1
        began = clock()
        got = ask(pending, max(min(wait, left), 0.0))
        refused = {n: a.reason for n, a in got.items() if isinstance(a, Refused)}
        if refused:
            raise PartitionQueryError(
                "seeded-sampling",
                [str(n) for n in refused],
                f"seeded sampling: the ClientApp of {len(refused)} node(s) failed "
                f"on the partition-id query: {_with_reasons(list(refused), refused)}"
                "; fix those nodes or set seeded-sampling=false",
            )
        for node in pending:
            answer = got.get(node, NoAnswer())
            if isinstance(answer, NoAnswer | Refused):  # Refused raised above
                reasons[node] = answer.reason
            else:
                answers[node] = answer
                reasons.pop(node, None)
        still = [n for n in pending if n not in answers]
        if still:
            LOGGER.warning(
                "fedadapt: partition-id query attempt %d: %d of %d node(s) have "
                "not answered (%s); asking again, at most %.0fs more (round-timeout)",
                attempt,
                len(still),
                len(pending),
                _with_reasons(still, reasons),
                max(start + deadline_s - clock(), 0.0),
            )
            wait *= 2
            rest = began + pause - clock()
            if rest > 0:
                sleep(min(rest, max(start + deadline_s - clock(), 0.0)))
    LOGGER.info(
        "fedadapt: partition-id query: %d node(s) answered in %d attempt(s), %.1fs",
        len(answers),
        attempt,
        clock() - start,
    )
    return answers


def _with_reasons(nodes: list[K], reasons: Mapping[K, str]) -> str:
    """``node (reason)`` for the first nodes, as :func:`show`."""
    return show(f"{n} ({reasons.get(n, 'no reply')})" for n in nodes)


def partition_ids(answers: Mapping[K, Mapping[str, Any]]) -> dict[K, int]:
    """Return node -> partition-id from the nodes' answers.

    An integer ``partition-id`` (not a bool) is the node's key. An answer
    without one (a node with only its own data) is kept out, logged and
    counted: that node sorts after the numbered ones. Any other value (a
    float, NaN, a bool, a string) is a misconfigured node that would sort
    by its random node id: :class:`~fedadapt.errors.PartitionQueryError`
    (key ``seeded-sampling``). Two nodes with one partition-id are logged.
    """
    keys: dict[K, int] = {}
    invalid: dict[K, Any] = {}
    for node, answer in answers.items():
        if wire.PARTITION_ID not in answer:
            continue
        pid = answer[wire.PARTITION_ID]
        if isinstance(pid, int) and not isinstance(pid, bool):
            keys[node] = pid
        else:  # 3.0 too: the ClientApp sends an int, so this node is not ours
            invalid[node] = pid
    if invalid:
        raise PartitionQueryError(
            "seeded-sampling",
            [str(n) for n in invalid],
            f"seeded sampling: {len(invalid)} node(s) report a partition-id that "
            f"is not an integer: {show(f'{n} ({v!r})' for n, v in invalid.items())}; "
            "give each SuperNode --node-config 'partition-id=<int>' or set "
            "seeded-sampling=false",
        )
    unnumbered = [n for n in answers if n not in keys]
    if unnumbered:
        LOGGER.warning(
            "fedadapt: %d of %d node(s) report no partition-id (own data-path "
            "only): %s; they are sampled after the numbered nodes, by node id, "
            "not reproducibly (give each a partition-id)",
            len(unnumbered),
            len(answers),
            show(unnumbered),
        )
    if len(set(keys.values())) < len(keys):
        LOGGER.warning(
            "fedadapt: several nodes report the same "
            "partition-id; check each SuperNode's --node-config",
        )
    return keys


def query_partition_ids(
    nodes: Callable[[], Iterable[K]],
    ask: Callable[[list[K], float], Mapping[K, Answer]],
    deadline_s: float,
) -> dict[K, int]:
    """:func:`collect_answers` then :func:`partition_ids` (the whole query)."""
    return partition_ids(collect_answers(nodes, ask, deadline_s))
