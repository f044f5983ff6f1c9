"""Seeded sampling under load (issue #39, item 4): the partition-id query.

A node that answers the partition-id query late must not change the sample:
the query asks again until every node answered, or fails the run naming the
nodes and the key to raise (``round-timeout``) — never samples without them.
Invalid answers fail at once (key ``seeded-sampling``). Both APIs: the
Message API's :func:`~fedadapt.server.server_app.node_partitions` with a fake
Grid whose nodes answer after a delay, the legacy strategy with fake
``ClientProxy``s whose first ``get_properties`` fails; and one Flower
simulation whose ClientApps sleep on their first message.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import Code, GetPropertiesRes, Status, ndarrays_to_parameters
from flwr.common.constant import ErrorCode
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from fedadapt.errors import PartitionQueryError
from fedadapt.server import partition_query
from fedadapt.server.partition_query import (
    NoAnswer,
    Refused,
    collect_answers,
    partition_ids,
)
from fedadapt.server.policy import LegacyRunStrategy, RunStrategy
from fedadapt.server.server_app import node_partitions
from fedadapt.strategies.core import FedAvgRule
from tests.helpers import run_in_process

NUM_NODES, PER_ROUND, ROUNDS = 8, 3, range(1, 11)

pytestmark = pytest.mark.usefixtures("task_identity")
ARRAYS = ArrayRecord({"w": Array(np.zeros(3, np.float32))})


@pytest.fixture(autouse=True)
def _quick_attempts(monkeypatch):
    """First attempt waits 0.05 s (not 60 s): "late" is then 0.3 s."""
    monkeypatch.setattr(partition_query, "QUERY_ATTEMPT_S", 0.05)
    monkeypatch.setattr(partition_query, "QUERY_PAUSE_S", 0.01)


# --- a fake Grid: nodes that answer after a delay ----------------------------------


class FakeGrid:
    """A Grid whose node ``n`` answers a query ``delay[n]`` s after it was pushed.

    ``answers[n]`` is the metrics the node replies with, or an ``int`` error
    code; ``errors_first[n]`` error codes are replied to its first messages
    before it answers. ``send_and_receive`` is InMemoryGrid's (push, then
    pull until all replied or ``timeout``).
    """

    def __init__(self, answers, delay=None, errors_first=None):
        self.answers = answers
        self.delay = delay or {}
        self.errors_first = {n: list(c) for n, c in (errors_first or {}).items()}
        self.pushed: dict[str, tuple[int, float]] = {}
        self.sent_to: list[int] = []

    def get_node_ids(self):
        return list(self.answers)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            node = message.metadata.dst_node_id
            assert message.metadata.message_type == "query"
            self.pushed[message.metadata.message_id] = (node, time.monotonic())
            self.sent_to.append(node)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        replies = []
        for mid in message_ids:
            node, at = self.pushed.get(mid, (None, 0.0))
            if node is None or time.monotonic() < at + self.delay.get(node, 0.0):
                continue
            del self.pushed[mid]
            queued = self.errors_first.get(node)
            answer = queued.pop(0) if queued else self.answers[node]
            replies.append(_reply(node, mid, answer))
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        ids = set(self.push_messages(messages))
        end, got = time.monotonic() + (timeout or 0.0), []
        while ids and time.monotonic() < end:
            for reply in self.pull_messages(ids):
                ids.discard(reply.metadata.reply_to_message_id)
                got.append(reply)
            time.sleep(0.01)
        return got


def _reply(node, reply_to, answer):
    message = Mock(spec=Message)
    message.metadata.src_node_id = node
    message.metadata.reply_to_message_id = reply_to
    message.has_error.return_value = isinstance(answer, int)
    if isinstance(answer, int):
        message.error.code, message.error.reason = answer, f"code {answer}"
    else:
        message.content = RecordDict({"metrics": MetricRecord(answer)})
    return message


def _federation(run_seed, delay=0.0):
    """Random node ids holding partitions 0..NUM_NODES-1 in a random order."""
    rng = random.Random(run_seed)
    nodes = [rng.getrandbits(63) for _ in range(NUM_NODES)]
    pids = rng.sample(range(NUM_NODES), NUM_NODES)
    answers = {
        n: {"partition-id": p, "num-partitions": NUM_NODES}
        for n, p in zip(nodes, pids, strict=True)
    }  # noqa: E501
    return FakeGrid(answers, delay=dict.fromkeys(nodes, delay)), dict(
        zip(nodes, pids, strict=True)
    )


def _samples(keys, grid):
    """The partitions a seeded RunStrategy trains in ROUNDS with ``keys``."""
    strategy = RunStrategy(
        FedAvgRule(),
        fraction_train=PER_ROUND / NUM_NODES,
        min_train_nodes=PER_ROUND,
        min_available_nodes=PER_ROUND,
        sampling_seed=7,
        node_keys=keys,
    )
    truth = {n: a["partition-id"] for n, a in grid.answers.items()}
    return [
        sorted(
            truth[m.metadata.dst_node_id]
            for m in strategy.configure_train(r, ARRAYS, ConfigRecord(), grid)
        )
        for r in ROUNDS
    ]


def test_late_query_answers_give_the_sample_of_prompt_answers():
    """Nodes answering 0.3 s late (six first waits) train what prompt nodes
    train: the query pulls until they answered, and sends each node one
    message. (Before: the query gave up after its wait, the late nodes sorted
    by random node id, and the run trained other partitions.)"""
    prompt_grid, truth = _federation(run_seed=1)
    late_grid, late_truth = _federation(run_seed=2, delay=0.3)
    prompt = node_partitions(prompt_grid, timeout=10.0)
    late = node_partitions(late_grid, timeout=10.0)
    assert prompt == truth and late == late_truth
    assert sorted(late_grid.sent_to) == sorted(late_truth)  # one message each
    first, second = _samples(prompt, prompt_grid), _samples(late, late_grid)
    print("prompt:", first, "\nlate:  ", second)
    assert first == second


def test_expired_query_is_asked_again():
    """A reply saying the message expired or the node was unavailable is no
    answer: the node gets a new message and its answer counts."""
    grid, truth = _federation(run_seed=3)
    first, second = list(truth)[:2]
    grid.errors_first = {
        first: [ErrorCode.MESSAGE_UNAVAILABLE],
        second: [ErrorCode.NODE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE],
    }
    assert node_partitions(grid, timeout=10.0) == truth
    assert grid.sent_to.count(first) == 2 and grid.sent_to.count(second) == 3


def test_unanswered_query_fails_the_run_naming_the_nodes_and_the_key():
    """Nodes that never answer within round-timeout end the run with the
    nodes and the key in the message, instead of a different sample."""
    grid, truth = _federation(run_seed=4)
    silent = sorted(truth)[:2]
    grid.delay.update(dict.fromkeys(silent, 3600.0))
    with pytest.raises(PartitionQueryError) as failed:
        node_partitions(grid, timeout=0.4)
    assert failed.value.key == "round-timeout"
    assert sorted(failed.value.nodes) == sorted(map(str, silent))
    message = str(failed.value)
    assert all(str(n) in message for n in silent)
    assert "raise round-timeout" in message and "2 node(s)" in message


def test_a_client_app_failing_on_the_query_fails_the_run_at_once():
    grid, truth = _federation(run_seed=5)
    broken = next(iter(truth))
    grid.answers[broken] = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    began = time.monotonic()
    with pytest.raises(PartitionQueryError) as failed:
        node_partitions(grid, timeout=60.0)
    assert time.monotonic() - began < 5.0  # not asked until round-timeout
    assert failed.value.key == "seeded-sampling"
    assert failed.value.nodes == [str(broken)]


@pytest.mark.parametrize("value", [1.5, 3.0, float("nan"), [1, 2]])
def test_invalid_partition_id_fails_the_run_naming_the_node(value):
    """A partition-id that is not an integer would sort the node by its
    random node id: the run fails (key seeded-sampling) and says the value."""
    grid, truth = _federation(run_seed=6)
    bad = next(iter(truth))
    grid.answers[bad] = {"partition-id": value}
    with pytest.raises(PartitionQueryError) as failed:
        node_partitions(grid, timeout=10.0)
    assert failed.value.key == "seeded-sampling"
    assert failed.value.nodes == [str(bad)]
    assert repr(value) in str(failed.value) and "--node-config" in str(failed.value)


def test_a_node_without_partition_id_is_kept_logged_and_sorted_last(caplog):
    """A SuperNode with only its own data-path answers without a partition-id:
    a configuration (docs/deployment.md), not a race: counted in the log, no
    key, and the run goes on."""
    grid, truth = _federation(run_seed=7)
    own_data = next(iter(truth))
    grid.answers[own_data] = {}
    keys = node_partitions(grid, timeout=10.0)
    assert own_data not in keys and len(keys) == NUM_NODES - 1
    assert "1 of 8 node(s) report no partition-id" in caplog.text


# --- the shared loop, Flower-free ---------------------------------------------------


def test_collect_answers_asks_only_the_nodes_that_have_not_answered():
    calls = []
    pending_rounds = {"a": 0, "b": 2}  # b answers on the third attempt

    def ask(nodes, wait):
        calls.append((list(nodes), wait))
        got = {}
        for n in nodes:
            if pending_rounds[n]:
                pending_rounds[n] -= 1
                got[n] = NoAnswer("busy")
            else:
                got[n] = {"partition-id": ord(n)}
        return got

    answers = collect_answers(lambda: ["a", "b"], ask, 10.0, attempt_s=1.0)
    assert answers == {"a": {"partition-id": 97}, "b": {"partition-id": 98}}
    assert calls == [(["a", "b"], 1.0), (["b"], 2.0), (["b"], 4.0)]  # doubling


def test_collect_answers_stops_waiting_for_a_node_that_left():
    connected = ["a", "b"]

    def ask(nodes, wait):
        connected[:] = ["a"]  # b disconnects: it will not be sampled
        return {"a": {"partition-id": 0}}

    assert collect_answers(lambda: list(connected), ask, 10.0) == {
        "a": {"partition-id": 0}
    }


def test_refused_answer_raises_at_once():
    with pytest.raises(PartitionQueryError, match="ClientApp of 1 node"):
        collect_answers(lambda: ["a"], lambda n, w: {"a": Refused("boom")}, 10.0)


@pytest.mark.parametrize("value", [True, "2", None, 2.0])
def test_partition_ids_refuses_what_is_not_an_integer(value):
    """As a legacy get_properties may report (a bool, a string): refused."""
    answers = {"a": {"partition-id": 2}, "b": {"partition-id": value}, "c": {}}
    with pytest.raises(PartitionQueryError, match="not an integer") as failed:
        partition_ids(answers)
    assert failed.value.nodes == ["b"]
    assert partition_ids({"a": {"partition-id": 2}, "c": {}}) == {"a": 2}


# --- the legacy API: ClientProxys whose first get_properties fails -----------------


def _legacy_federation(run_seed, fail_first=0):
    """A SimpleClientManager with random cids; each client's first
    ``fail_first`` get_properties raise (as a timed-out proxy does)."""
    rng = random.Random(run_seed)
    manager, truth = SimpleClientManager(), {}
    for pid in rng.sample(range(NUM_NODES), NUM_NODES):
        cid = str(rng.getrandbits(63))
        proxy = Mock(spec=ClientProxy)
        proxy.cid = cid
        answer = GetPropertiesRes(Status(Code.OK, ""), {"partition-id": pid})
        timeout = ValueError("Message contains an Error (reason: TTL expired)")
        proxy.get_properties.side_effect = [timeout] * fail_first + [answer] * 10
        manager.register(proxy)
        truth[cid] = pid
    return manager, truth


def _legacy_samples(manager, truth, query_timeout=10.0):
    strategy = LegacyRunStrategy(
        FedAvgRule(),
        sampling_seed=7,
        query_timeout=query_timeout,
        fraction_fit=0.0,
        min_fit_clients=PER_ROUND,
        min_available_clients=PER_ROUND,
    )
    parameters = ndarrays_to_parameters([np.zeros(3, np.float32)])
    samples = [
        sorted(truth[p.cid] for p, _ in strategy.configure_fit(r, parameters, manager))
        for r in ROUNDS
    ]
    return samples, strategy


def test_legacy_late_answers_give_the_sample_of_prompt_answers():
    """Clients whose first get_properties times out are asked again and
    train what prompt clients train (before: asked once, sorted last)."""
    prompt, _ = _legacy_samples(*_legacy_federation(run_seed=1))
    late, strategy = _legacy_samples(*_legacy_federation(run_seed=2, fail_first=2))
    print("prompt:", prompt, "\nlate:  ", late)
    assert late == prompt
    assert sorted(strategy.partitions.values()) == list(range(NUM_NODES))


def test_legacy_unanswered_query_fails_naming_the_clients_and_the_key():
    manager, truth = _legacy_federation(run_seed=3, fail_first=10_000)
    with pytest.raises(PartitionQueryError) as failed:
        _legacy_samples(manager, truth, query_timeout=0.3)
    assert failed.value.key == "round-timeout"
    assert sorted(failed.value.nodes) == sorted(truth)
    assert "TTL expired" in str(failed.value)


# --- a real Flower simulation with slow ClientApps ---------------------------------


# two Ray simulations, ~2 min on 2 cores: with make test-deploy (CI runs it),
# to keep the default suite within CI's 20 minutes; the unit tests above run
# the same late answers against the shared query loop of both APIs
@pytest.mark.e2e
@pytest.mark.deploy
def test_simulation_with_slow_client_start_trains_the_prompt_partitions(
    tmp_path, monkeypatch
):
    """Two simulations with the same seed train the same partitions and end
    with the same model: one prompt (the default first wait), one whose
    ClientApps sleep 1 s on their first message, with a first wait of 0.05 s
    (so with Ray's start-up every node answers many waits late). Before, a
    node that missed the wait sorted by its random node id: the delayed run
    trained other clients."""
    from fedadapt.client import client_app

    marks = tmp_path / "started"
    marks.mkdir()

    def slow_query(msg, context):  # runs in the Ray actors
        mark = marks / str(context.node_config["partition-id"])
        if not mark.exists():
            mark.touch()
            time.sleep(1.0)  # a slow actor start-up
        return client_app.query(msg, context)

    runs = {}
    for name, query, first_wait in (
        ("prompt", None, 60.0),  # the default: answered in the first wait
        ("delayed", slow_query, 0.05),
    ):
        monkeypatch.setattr(partition_query, "QUERY_ATTEMPT_S", first_wait)
        run_in_process(
            {
                "output-dir": str(tmp_path),
                "run-name": name,
                "num-server-rounds": 2,
                "clients-per-round": 2,
                "clients-per-eval": 0,
                "local-steps": 1,
            },
            num_supernodes=6,
            client_query=query,
        )
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    sampled = {n: [r["sampled"]["train"] for r in runs[n]["rounds"]] for n in runs}
    print("sampled partitions:", sampled)
    assert {r["status"] for r in runs.values()} == {"completed"}
    assert len(list(marks.iterdir())) == 6  # every delayed ClientApp slept
    assert sampled["prompt"] == sampled["delayed"]
    losses = {n: [r["eval"]["loss"] for r in runs[n]["rounds"]] for n in runs}
    assert losses["prompt"] == losses["delayed"]
