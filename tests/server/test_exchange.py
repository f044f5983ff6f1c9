"""Issue #40 item 2: the ServerApp's own wait for replies in deployment.

:func:`fedadapt.server.exchange.exchange` must give the replies Flower's
``send_and_receive`` gives (the oracle: Flower 1.42's own ``HttpGrid`` and
``InMemoryGrid`` loops, run on the same stand-in SuperLink), only sooner;
its pulls back off to a cap and stay bounded on a long wait; a timeout
returns what arrived. The simulation's ``InMemoryGrid`` keeps Flower's loop.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

import pytest
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.server.superlink.linkstate.utils import (
    create_message_error_unavailable_res_message,
)
from flwr.serverapp import Grid
from flwr.superlink.grid import HttpGrid, InMemoryGrid

from fedadapt.server import exchange as ex
from fedadapt.server import server_app
from fedadapt.strategies.adapter import FederationFailedError

pytestmark = pytest.mark.usefixtures("task_identity")

NEVER = None


class FakeLink:
    """A SuperLink stand-in: node ``n``'s reply is in after ``answers[n]`` pulls.

    A pull hands each reply out once (the SuperLink marks it delivered).
    ``answers[n]`` is ``(pulls, kind)``: kind ``ok`` (the ClientApp's reply),
    ``error`` (the ClientApp failed), ``expired`` (the SuperLink's own error
    reply for a message whose TTL ran out or whose node went away); ``NEVER``
    never answers. Node ``-1``'s message cannot be pushed (id None).
    """

    def __init__(self, answers: dict[int, tuple[int, str] | None]) -> None:
        self.answers = answers
        self.pulls = 0
        self.pulled_ids: list[list[str]] = []
        self.sent: dict[str, Message] = {}
        self.delivered: set[str] = set()

    def push_messages(self, messages: Iterable[Message]) -> list[str | None]:
        ids: list[str | None] = []
        for i, msg in enumerate(messages):
            if msg.metadata.dst_node_id == -1:
                ids.append(None)
                continue
            msg_id = f"m{i}"
            msg.metadata.__dict__["_message_id"] = msg_id
            self.sent[msg_id] = msg
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        self.pulls += 1
        ids = list(message_ids)
        self.pulled_ids.append(ids)
        assert None not in ids  # Flower's SuperLink cannot look None up
        out = []
        for msg_id in ids:
            msg = self.sent[msg_id]
            answer = self.answers[msg.metadata.dst_node_id]
            if answer is NEVER or msg_id in self.delivered or self.pulls < answer[0]:
                continue
            self.delivered.add(msg_id)
            out.append(_reply(msg, answer[1]))
        return out


def _reply(msg: Message, kind: str) -> Message:
    if kind == "ok":
        return Message(RecordDict(), reply_to=msg)
    if kind == "error":
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION), reply_to=msg)
    return create_message_error_unavailable_res_message(msg.metadata, "ttl")


def _messages(nodes: Iterable[int]) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=n, message_type="train") for n in nodes]


def _summary(replies: Iterable[Message]) -> list[tuple[str, int | None]]:
    return [
        (m.metadata.reply_to_message_id, m.error.code if m.has_error() else None)
        for m in replies
    ]


class FakeClock:
    """``clock`` and ``sleep`` for :func:`exchange`: time moves by sleeping."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


def _flower(loop, link: FakeLink, messages, timeout, monkeypatch) -> FakeClock:
    """Run Flower's own ``send_and_receive`` (``loop``) on ``link``, fake time.

    Returns the clock; the replies are in ``clock.replies``.
    """
    import time

    clock = FakeClock()
    monkeypatch.setattr(time, "sleep", clock.sleep)
    monkeypatch.setattr(time, "time", clock.clock)
    link.pull_interval = 0.1  # InMemoryGrid's attribute (HttpGrid: 3 s)
    clock.replies = list(loop(link, messages, timeout=timeout))
    monkeypatch.undo()
    return clock


ANSWERS = {
    1: (1, "ok"),  # in at the first pull
    2: (3, "ok"),
    3: (2, "error"),  # the ClientApp raised
    4: (4, "expired"),  # the SuperLink's error reply (TTL / node gone)
    5: (3, "ok"),  # in at the same pull as node 2
}


@pytest.mark.parametrize(
    "loop", [HttpGrid.send_and_receive, InMemoryGrid.send_and_receive]
)
def test_the_same_replies_as_flowers_loop_in_the_same_pulls(loop, monkeypatch):
    clock = FakeClock()
    ours_link, flower_link = FakeLink(ANSWERS), FakeLink(ANSWERS)
    ours = ex.exchange(
        ours_link, _messages(ANSWERS), clock=clock.clock, sleep=clock.sleep
    )
    flower = _flower(loop, flower_link, _messages(ANSWERS), None, monkeypatch)
    # the same replies; in pull order (within one pull: the SuperLink's order)
    assert sorted(_summary(ours)) == sorted(_summary(flower.replies))
    assert len(ours) == len(ANSWERS)  # no reply lost, none twice
    arrival = {f"m{i}": ANSWERS[n][0] for i, n in enumerate(ANSWERS)}
    for replies in (ours, flower.replies):
        pulls = [arrival[m.metadata.reply_to_message_id] for m in replies]
        assert pulls == sorted(pulls)
    codes = dict(_summary(ours))
    assert codes["m2"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert codes["m3"] == ErrorCode.NODE_UNAVAILABLE  # the SuperLink's own
    assert ours_link.pulls == flower_link.pulls == 4
    # each pull asks for the ids still outstanding, as Flower's does
    assert [sorted(p) for p in ours_link.pulled_ids] == [
        sorted(p) for p in flower_link.pulled_ids
    ]
    assert clock.sleeps == [0.05, 0.1, 0.2]
    assert flower.sleeps == [3 if loop is HttpGrid.send_and_receive else 0.1] * 3


def test_a_timeout_returns_the_replies_in_by_then(monkeypatch):
    answers = {1: (1, "ok"), 2: NEVER, 3: (5, "error"), -1: (1, "ok")}
    clock = FakeClock()
    link = FakeLink(answers)
    replies = ex.exchange(
        link, _messages(answers), timeout=10.0, clock=clock.clock, sleep=clock.sleep
    )
    failed = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert _summary(replies) == [("m0", None), ("m2", failed)]
    assert clock.now == pytest.approx(10.0)  # the last sleep ends at the deadline
    assert all("m3" not in ids for ids in link.pulled_ids)  # None is not pulled
    # Flower's loop (pulling every 0.1 s) on the same link: the same replies;
    # it would pull for id None, so that message is left out
    del answers[-1]
    flower = _flower(
        InMemoryGrid.send_and_receive, FakeLink(answers), _messages(answers), 10.0,
        monkeypatch,
    )  # fmt: skip
    assert _summary(flower.replies) == _summary(replies)


def test_a_reply_in_the_last_interval_is_pulled_at_the_deadline():
    clock = FakeClock()
    link = FakeLink({1: (1, "ok"), 2: NEVER})
    link.answers[2] = (6, "ok")  # 6th pull: after 0.05+0.1+0.2+0.4+0.5 = 1.25 s
    replies = ex.exchange(
        link, _messages([1, 2]), timeout=1.2, clock=clock.clock, sleep=clock.sleep
    )
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.45])
    assert _summary(replies) == [("m0", None), ("m1", None)]


def test_timeout_zero_pulls_nothing_as_flowers_loop():
    link = FakeLink({1: (1, "ok")})
    assert ex.exchange(link, _messages([1]), timeout=0) == []
    assert link.pulls == 0 and list(link.sent) == ["m0"]  # pushed, as Flower


def test_nothing_pushed_returns_at_once():
    link = FakeLink({-1: (1, "ok")})
    assert ex.exchange(link, _messages([])) == []
    assert ex.exchange(link, _messages([-1])) == []
    assert link.pulls == 0


@pytest.mark.parametrize("outstanding", [1, 2, 100, 500, 1000, 2000, 3000, 10**5])
def test_pull_intervals_grow_to_a_cap_that_scales_with_the_ids(outstanding):
    sleeps = list(itertools.islice(ex.pull_intervals(outstanding), 40))
    floor, cap = ex.schedule(outstanding)
    assert sleeps[0] == floor and max(sleeps) == sleeps[-1] == cap
    assert all(a <= b for a, b in itertools.pairwise(sleeps))  # never shrinks
    assert ex.FIRST_PULL_S <= floor <= cap <= ex.FLOWER_PULL_S  # never Flower's+
    # ids looked up per second by this ServerApp: at most 1000 (or Flower's n/3)
    assert outstanding / floor <= max(1 / ex.PULL_S_PER_ID, outstanding / 3) + 1e-9
    if outstanding <= 50:
        assert (floor, cap) == (0.05, 0.5)
    if outstanding >= 1000:
        assert floor == cap  # a thousand idle nodes: no ramp, ≥ 1 s apart


@pytest.mark.parametrize("outstanding", [2, 1000])
def test_a_long_wait_costs_a_bounded_number_of_pulls(outstanding):
    clock = FakeClock()
    link = FakeLink({n: NEVER for n in range(outstanding)})
    replies = ex.exchange(
        link, _messages(range(outstanding)), timeout=3600.0,
        clock=clock.clock, sleep=clock.sleep,
    )  # fmt: skip
    assert replies == [] and clock.now == pytest.approx(3600.0)
    assert link.pulls <= ex.max_pulls(outstanding, 3600.0)
    _, cap = ex.schedule(outstanding)
    assert link.pulls <= 3600.0 / cap + 6  # 2 a second for 2 nodes, 1 for 1000


# --- which grid pulls fast: deployment yes, simulation no ---------------------


class DeployedGrid(Grid):
    """A deployment grid (not InMemoryGrid) whose replies are all errors.

    Its own ``send_and_receive`` is the slow path and must not be used.
    """

    def __init__(self) -> None:
        self.link = FakeLink({1: (1, "error"), 2: (2, "error")})
        self.closed = False

    def set_run(self, run):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def get_node_ids(self):
        return [1, 2]

    def push_messages(self, messages):
        messages = list(messages)
        for msg in messages:  # ids unique across exchanges
            msg.metadata.__dict__["_message_id"] = f"x{len(self.link.sent)}"
            self.link.sent[msg.metadata.message_id] = msg
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        return self.link.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("Flower's 3-s loop was used in deployment")

    def close(self):
        self.closed = True


def test_fast_pull_wraps_deployment_grids_only(monkeypatch):
    from flwr.supercore.inflatable import inflatable_utils

    retry = inflatable_utils.pull_objects.__kwdefaults__
    monkeypatch.setitem(retry, "initial_backoff", 1)  # Flower's
    simulated = InMemoryGrid.__new__(InMemoryGrid)
    assert ex.fast_pull(simulated) is simulated  # the simulation keeps Flower's
    assert retry["initial_backoff"] == 1
    deployed = DeployedGrid()
    wrapped = ex.fast_pull(deployed)
    # a reply's objects missing at the first pull are asked for after 0.05 s
    assert retry["initial_backoff"] == 0.05
    assert isinstance(wrapped, ex.PullingGrid) and wrapped.grid is deployed
    assert ex.fast_pull(wrapped) is wrapped  # never twice
    wrapped.close()  # what the wrapper lacks is the grid's
    assert deployed.closed and list(wrapped.get_node_ids()) == [1, 2]
    stand_in = object()
    assert ex.fast_pull(stand_in) is stand_in  # type: ignore[arg-type]


def _run_main(grid, tmp_path) -> dict:
    context = Context(1, 0, {}, RecordDict(), {
        "output-dir": str(tmp_path), "run-name": "r", "num-server-rounds": 2,
        "clients-per-round": 2, "evaluate-every": 0,
    })  # fmt: skip
    with pytest.raises(FederationFailedError, match="no round of the run used"):
        server_app.main(grid, context)
    return json.loads((tmp_path / "r" / "results.json").read_text())


def test_the_deployed_server_app_pulls_every_exchange_itself(tmp_path):
    grid = DeployedGrid()
    data = _run_main(grid, tmp_path)
    assert [r["replies"]["failed"] for r in data["rounds"]] == [2, 2]
    # 2 train exchanges (no federated evaluation), pulled by fedadapt: round
    # 1 until node 2 answered at the 2nd pull, round 2 at once
    assert len(grid.link.sent) == 4 and grid.link.pulls == 3


def test_the_simulated_server_app_keeps_flowers_loop(tmp_path):
    from unittest.mock import Mock

    grid = Mock(spec=InMemoryGrid)
    grid.get_node_ids.return_value = [1, 2]
    grid.send_and_receive.side_effect = lambda messages, timeout=None: [
        _reply(m, "error") for m in messages
    ]
    data = _run_main(grid, tmp_path)
    assert [r["replies"]["failed"] for r in data["rounds"]] == [2, 2]
    # train ×2; an evaluate phase with no messages calls no grid (#40 item 1)
    assert grid.send_and_receive.call_count == 2
    grid.push_messages.assert_not_called()
    grid.pull_messages.assert_not_called()
