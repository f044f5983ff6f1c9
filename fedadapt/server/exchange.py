"""The ServerApp's wait for replies in deployment: pull soon, then back off.

Flower 1.42's deployment grid (``HttpGrid.send_and_receive``) pushes the
messages, pulls once, and then sleeps a fixed 3 s between pulls until every
reply is in: each exchange (train, evaluate) waits on average 1.5 s, and up
to 3 s, after its last reply reached the SuperLink. :func:`exchange` does the
same push and pulls with the grid's own public ``push_messages`` /
``pull_messages``, but at an interval that starts at :data:`FIRST_PULL_S`
and doubles up to :data:`MAX_PULL_S` (:func:`pull_intervals`), and it
returns as soon as every reply is in or ``timeout`` has passed.

The simulation keeps Flower's loop: its ``InMemoryGrid`` pulls from memory
every 0.1 s, cheaper than anything here (#30). :func:`fast_pull` therefore
wraps every other :class:`~flwr.serverapp.Grid` in a :class:`PullingGrid`
and hands an ``InMemoryGrid`` (and anything that is not a Grid) back as is.

What the numbers cost the SuperLink. Each pull is one ``PullMessages``
request whose SQL looks up every id still outstanding; a ServerApp that
pulls n ids every t s asks it to look up n/t ids a second (Flower's: n/3).

* Few nodes: at most 1/:data:`FIRST_PULL_S` = 20 requests a second, only
  for the first 0.05 + 0.1 + 0.2 + 0.4 = 0.75 s; then 1/:data:`MAX_PULL_S`
  = 2 a second. :data:`MAX_PULL_S` = 0.5 s is the interval at which a Flower
  SuperNode polls for the reply it waits for (§13 of the Flower notes); an
  exchange in deployment lasts seconds (a new ``flwr-clientapp`` process per
  message), so it waits 0.25 s on average after its last reply instead of
  1.5 s.
* Many nodes: the first interval is at least :data:`PULL_S_PER_ID` = 1 ms
  per outstanding id (a thousand idle nodes: one pull a second; the
  SuperLink then looks up at most 1000 ids a second for this ServerApp,
  while those thousand SuperNodes already send it 333 polls a second of
  their own, one every 3 s each), and never above Flower's 3 s
  (:data:`FLOWER_PULL_S`): with 3000 or more ids the pace is Flower's.

The schedule is fixed at push time by the number of ids pushed, so the
intervals never shrink as replies come in, and a long wait costs a bounded
number of pulls: one, plus one per sleep of the ramp to the cap, plus
``timeout / cap`` rounded up (:func:`max_pulls`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid

#: Seconds before the second pull (the first follows the push at once).
FIRST_PULL_S = 0.05
#: Each interval is this many times the one before, up to the cap.
PULL_GROWTH = 2.0
#: The cap of the interval for up to 500 outstanding ids.
MAX_PULL_S = 0.5
#: The first interval (and the cap) is at least this many seconds per id.
PULL_S_PER_ID = 0.001
#: Flower's fixed interval: the schedule is never slower than this.
FLOWER_PULL_S = 3.0


class Exchanging(Protocol):
    """What :func:`exchange` uses of a Flower ``Grid``."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push ``messages``; return their ids (Flower: None for one not pushed)."""
        ...  # pragma: no cover

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Return the replies to ``message_ids`` that are in (each one once)."""
        ...  # pragma: no cover


def schedule(outstanding: int) -> tuple[float, float]:
    """Return (first interval, cap) in seconds for ``outstanding`` ids pushed."""
    floor = min(max(FIRST_PULL_S, outstanding * PULL_S_PER_ID), FLOWER_PULL_S)
    return floor, max(MAX_PULL_S, floor)


def pull_intervals(outstanding: int) -> Iterator[float]:
    """Yield the sleeps between pulls: from the floor, ×2 up to the cap, forever.

    ``outstanding`` is the number of ids pushed (see :func:`schedule`).
    """
    interval, cap = schedule(outstanding)
    while True:
        yield interval
        interval = min(interval * PULL_GROWTH, cap)


def max_pulls(outstanding: int, wait: float) -> int:
    """Upper bound of the pulls :func:`exchange` makes in ``wait`` seconds."""
    floor, cap = schedule(outstanding)
    ramp = math.ceil(math.log(cap / floor, PULL_GROWTH)) if cap > floor else 0
    return 1 + ramp + math.ceil(wait / cap)


def exchange(
    grid: Exchanging,
    messages: Iterable[Message],
    *,
    timeout: float | None = None,
    intervals: Callable[[int], Iterator[float]] = pull_intervals,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Any] = time.sleep,
) -> list[Message]:
    """Push ``messages``, then pull their replies until all are in or ``timeout``.

    The same contract as Flower's ``Grid.send_and_receive`` (1.42's
    ``HttpGrid`` and ``InMemoryGrid``): the messages are pushed once; every
    reply a pull returns is kept, in pull order, including the error replies
    the SuperLink makes for a message whose TTL expired or whose node went
    away (they answer that message as any reply does); a message counts as
    answered when a reply names it in ``reply_to_message_id``; ``timeout``
    None waits for every reply; with a ``timeout`` the replies in by then
    are returned, and one of 0 or less returns without pulling (as Flower
    does). Two differences, both in the caller's favour: the sleeps follow
    ``intervals`` (:func:`pull_intervals`) instead of 3 s, and the last
    sleep ends at the deadline, followed by a last pull, where Flower
    sleeps past it and does not pull again. An id that ``push_messages``
    gives as None (a message it could not push; Flower logs a warning) is
    not pulled for: it would never be answered.

    Parameters
    ----------
    grid : Exchanging
        The grid (``push_messages``, ``pull_messages``).
    messages : Iterable[Message]
        The messages to send.
    timeout : float | None (default: None)
        Seconds to wait for replies after the push; None: until all are in.
    intervals : Callable[[int], Iterator[float]]
        The sleeps between pulls for a number of ids pushed.
    clock, sleep : Callable
        Time source and sleep (tests pass fakes).

    Returns
    -------
    list[Message]
        The replies received, in the order pulled.
    """
    outstanding = {i for i in grid.push_messages(messages) if i is not None}
    del messages
    replies: list[Message] = []
    if not outstanding or (timeout is not None and timeout <= 0):
        return replies
    deadline = None if timeout is None else clock() + timeout
    waits = intervals(len(outstanding))
    while True:
        pulled = list(grid.pull_messages(sorted(outstanding)))
        replies.extend(pulled)
        outstanding.difference_update(m.metadata.reply_to_message_id for m in pulled)
        if not outstanding:
            return replies
        wait = next(waits)
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                return replies
            wait = min(wait, left)
        sleep(wait)


class PullingGrid(Grid):
    """A deployment grid whose ``send_and_receive`` is :func:`exchange`.

    Every other method, and any attribute a Grid subclass adds (``close``,
    ``node``), is the wrapped grid's, so Flower's strategies, fedadapt's
    round loop and its queries all pull through this one grid.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run: Any) -> None:
        """Set the wrapped grid's run."""
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create a message as the wrapped grid does (deprecated in Flower)."""
        return self.grid.create_message(
            content, message_type, dst_node_id, group_id, ttl
        )

    def get_node_ids(self) -> Iterable[int]:
        """Return the wrapped grid's connected nodes."""
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        """Return the wrapped grid's node information."""
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push through the wrapped grid."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull through the wrapped grid."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull at :func:`pull_intervals` (see :func:`exchange`)."""
        return exchange(self.grid, messages, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class lacks (close, node, _run, ...)
        if name == "grid":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.grid, name)


def fast_pull(grid: Grid) -> Grid:
    """Return ``grid`` with :func:`exchange` as its wait, where that is faster.

    A deployment grid (any :class:`~flwr.serverapp.Grid` but Flower's
    ``InMemoryGrid``) comes back wrapped in a :class:`PullingGrid`; the
    simulation's ``InMemoryGrid``, a grid already wrapped, and stand-ins that
    are no Grid come back unchanged. In deployment it also has this process
    retry a reply's missing objects after 0.05 s instead of Flower's 1 s
    (:mod:`fedadapt.server.object_pull`).
    """
    if not isinstance(grid, Grid) or isinstance(grid, InMemoryGrid | PullingGrid):
        return grid
    from fedadapt.server.object_pull import shorten_object_pull_retry

    shorten_object_pull_retry()  # a reply's objects trail its metadata by ms
    return PullingGrid(grid)
