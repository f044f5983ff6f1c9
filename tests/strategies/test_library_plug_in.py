"""A two-round plug-in run with only flwr + numpy (issue #27).

What a user of the installed wheel does: a Flower ``ClientApp`` of the usual
quickstart shape and one of our strategies driven by Flower's own
``Strategy.start`` round loop. A loopback grid hands each message to the
ClientApp in-process (no SuperLink, no Ray), so this runs in the clean venvs
of ``make test-flower-versions`` (oldest and newest supported Flower, no
PyTorch) as in the default suite.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedadapt.strategies import FedAvg, FedDuA

pytestmark = pytest.mark.usefixtures("task_identity")

NODES = (1, 2, 3)
STEPS, LR = 5, 0.05
rng = np.random.default_rng(0)
W_TRUE = rng.normal(size=5)
DATA = {}
for _node in NODES:
    _x = rng.normal(size=(40, 5))
    DATA[_node] = (_x, _x @ W_TRUE + 0.01 * rng.normal(size=40))


def local_sgd(w: np.ndarray, node: int) -> np.ndarray:
    """STEPS full-batch gradient steps on the node's least squares."""
    x, y = DATA[node]
    for _ in range(STEPS):
        w = w - LR * x.T @ (x @ w - y) / len(y)
    return w


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    start = msg.content["arrays"]["w"].numpy()
    trained = local_sgd(start, context.node_id)
    metrics = MetricRecord(
        {"num-examples": len(DATA[context.node_id][1]),
         "update-sq-norm": float(np.sum((trained - start) ** 2))}
    )  # fmt: skip
    content = RecordDict(
        {"arrays": ArrayRecord({"w": Array(trained)}), "metrics": metrics}
    )
    return Message(content, reply_to=msg)


class LoopbackGrid(Grid):
    """Flower's Grid interface, answered by calling the ClientApp in-process."""

    def __init__(self, client_app: ClientApp) -> None:
        self._app = client_app
        self._run_id: int | None = None

    def set_run(self, run_id: int) -> None:
        self._run_id = run_id

    @property
    def run(self):  # noqa: D102 - Flower's interface
        return self._run_id

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(NODES)

    def push_messages(self, messages):
        raise NotImplementedError("send_and_receive answers in-process")

    def pull_messages(self, message_ids):
        raise NotImplementedError("send_and_receive answers in-process")

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            context = Context(1, node, {}, RecordDict(), {})
            replies.append(self._app(message, context))
        return replies


def _start(strategy, rounds: int = 2):
    distances: dict[int, float] = {}

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        w = arrays["w"].numpy()
        distances[server_round] = float(np.linalg.norm(w - W_TRUE))
        return MetricRecord({"distance": distances[server_round]})

    result = strategy.start(
        LoopbackGrid(app),
        ArrayRecord({"w": Array(np.zeros(5))}),
        num_rounds=rounds,
        evaluate_fn=central,
    )
    return result, distances


def test_fedavg_plug_in_returns_the_mean_of_the_clients_models():
    """Oracle: FedAvg over equal-sized clients is the plain mean of their
    locally trained models, round after round (computed here with numpy)."""
    result, _ = _start(FedAvg(fraction_evaluate=0.0))
    w = np.zeros(5)
    for _ in range(2):
        w = np.mean([local_sgd(w, node) for node in NODES], axis=0)
    np.testing.assert_allclose(result.arrays["w"].numpy(), w, rtol=1e-12)
    assert sorted(result.train_metrics_clientapp) == [1, 2]


def test_feddua_plug_in_runs_two_rounds_and_learns():
    result, distances = _start(FedDuA(fraction_evaluate=0.0))
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert sorted(distances) == [0, 1, 2]
    assert distances[2] < distances[1] < distances[0]
