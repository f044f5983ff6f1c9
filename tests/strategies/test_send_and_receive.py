"""fedadapt's exchange with the grid: Flower's contract, a shorter wait (#30)."""

from __future__ import annotations

from uuid import uuid4

import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.superlink.grid import InMemoryGrid

from fedadapt.strategies import _message_api
from fedadapt.strategies._message_api import send_and_receive

pytestmark = pytest.mark.usefixtures("task_identity")


class _NoState:
    def state(self):
        return None


class ScriptedGrid(InMemoryGrid):
    """Flower's in-memory grid (its own ``send_and_receive`` and interval)
    with push/pull scripted: ``arrivals[k]`` are the nodes whose replies the
    k-th pull returns; nodes never listed never answer."""

    def __init__(self, arrivals: list[list[int]]) -> None:
        super().__init__(_NoState())
        self.arrivals = list(arrivals)
        self.sent: dict[int, Message] = {}
        self.pulls: list[set[str]] = []

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
            self.sent[message.metadata.dst_node_id] = message
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        self.pulls.append(set(message_ids))
        nodes = self.arrivals.pop(0) if self.arrivals else []
        return [
            Message(
                RecordDict({"m": MetricRecord({"node": node})}),
                reply_to=self.sent[node],
            )
            for node in nodes
        ]


def _messages(nodes):
    return [Message(RecordDict(), dst_node_id=n, message_type="query") for n in nodes]


@pytest.fixture
def sleeps(monkeypatch):
    """Record the waits instead of sleeping; the clock advances by them."""
    clock = {"now": 1000.0}
    waits: list[float] = []

    def sleep(seconds):
        waits.append(seconds)
        clock["now"] += seconds

    monkeypatch.setattr(_message_api.time, "sleep", sleep)
    monkeypatch.setattr(_message_api.time, "monotonic", lambda: clock["now"])
    return waits


def _nodes(replies):
    return [r.content["m"]["node"] for r in replies]


def test_all_replies_in_arrival_order_with_waits_doubling_to_the_grids_interval(
    sleeps,
):
    grid = ScriptedGrid([[], [], [3], [], [], [], [], [1], [2]])
    replies = send_and_receive(grid, _messages([1, 2, 3]), timeout=None)
    assert _nodes(replies) == [3, 1, 2]
    # 9 pulls, a wait between each two: 5 ms doubling, capped at Flower's 0.1 s
    assert sleeps == pytest.approx([0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.1, 0.1])
    # each pull asks only for the replies still missing
    assert [len(p) for p in grid.pulls] == [3, 3, 3, 2, 2, 2, 2, 2, 1]
    assert all(r.metadata.reply_to_message_id for r in replies)


def test_timeout_returns_what_arrived_and_waits_no_longer(sleeps):
    grid = ScriptedGrid([[2]])  # node 1 never answers
    replies = send_and_receive(grid, _messages([1, 2]), timeout=0.3)
    assert _nodes(replies) == [2]
    assert sum(sleeps) == pytest.approx(0.3)  # the last wait is cut to the deadline
    assert max(sleeps) <= 0.1


def test_all_in_at_the_first_pull_waits_not_at_all(sleeps):
    grid = ScriptedGrid([[1, 2]])
    assert _nodes(send_and_receive(grid, _messages([1, 2]), timeout=10)) == [1, 2]
    assert sleeps == []
    assert send_and_receive(grid, [], timeout=10) == []


def test_a_grid_without_an_interval_waits_up_to_a_second(sleeps):
    grid = ScriptedGrid([[]] * 12 + [[1]])
    del grid.pull_interval  # e.g. Flower's HTTP grid of a deployment
    send_and_receive(grid, _messages([1]))
    assert max(sleeps) == pytest.approx(1.0) and sleeps[-1] == pytest.approx(1.0)


def test_a_grid_with_its_own_send_and_receive_is_used_as_it_is(sleeps):
    class OwnGrid(ScriptedGrid):
        def send_and_receive(self, messages, *, timeout=None):
            self.asked = (list(messages), timeout)
            return ["own"]

    grid = OwnGrid([])
    assert send_and_receive(grid, _messages([7]), timeout=5) == ["own"]
    assert [m.metadata.dst_node_id for m in grid.asked[0]] == [7]
    assert grid.asked[1] == 5 and grid.pulls == [] and sleeps == []
