"""In-process harness for the local-update tests: the strategy and fedadapt's
clients exchange real Flower messages and records without Flower's loop."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.server.client_proxy import ClientProxy
from torch import nn

from fedadapt.client import client_app, numpy_client
from fedadapt.strategies import wire
from fedadapt.tasks import TASKS


def global_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TASKS.get("digits-mlp").build_model().state_dict()


def linear_model(w: np.ndarray, b: np.ndarray) -> nn.Linear:
    """A float64 linear model with weight ``w`` (1 × d) and bias ``b``: the
    model of the tests' closed-form references."""
    model = nn.Linear(w.shape[1], 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(w))
        model.bias.copy_(torch.from_numpy(b))
    return model


RUN_CONFIG = {"task": "digits-mlp", "local-steps": 2, "batch-size": 16}


class Grid:
    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def make_contexts(num: int, run_config: dict | None = None) -> dict[int, Context]:
    """Nodes 1..num, partitions 0..num-1, each with ``run_config`` (RUN_CONFIG)."""
    return {
        node: Context(
            1,
            node,
            {"partition-id": node - 1, "num-partitions": num},
            RecordDict(),
            dict(RUN_CONFIG if run_config is None else run_config),
        )  # fmt: skip
        for node in range(1, num + 1)
    }


def message_rounds(
    strategy,
    contexts,
    rounds,
    replies_hook=None,
    first=1,
    *,
    lr=0.1,
    messages_hook=None,
):
    """Run ``rounds`` rounds: strategy ↔ fedadapt's ClientApp, without Flower's loop.

    Round ``first`` trains from the strategy's last model (the initial one
    when ``first`` is 1); every round's config carries learning rate ``lr``.
    ``messages_hook(server_round, messages)`` sees each round's train
    messages before the clients do, ``replies_hook(replies)`` their replies
    before the strategy does.
    """
    arrays = strategy.training_arrays if first > 1 else ArrayRecord(global_state())
    reports = []
    for server_round in range(first, first + rounds):
        messages = list(
            strategy.configure_train(
                server_round, arrays, ConfigRecord({wire.LR: lr}), Grid(list(contexts))
            )
        )
        if messages_hook is not None:
            messages_hook(server_round, messages)
        replies = [
            client_app.train(m, contexts[m.metadata.dst_node_id]) for m in messages
        ]
        if replies_hook is not None:
            replies_hook(replies)
        new, metrics = strategy.aggregate_train(server_round, replies)
        arrays = new if new is not None else arrays
        reports.append((metrics, strategy.round_reports[server_round]))
    return reports


class InProcessProxy(ClientProxy):
    """A legacy client proxy that runs fedadapt's NumPyClient in process."""

    def __init__(self, context: Context) -> None:
        super().__init__(str(context.node_id))
        self.context = context

    def fit(self, ins, timeout, group_id):
        client = numpy_client.client_fn(self.context)
        return client.fit(ins)

    def get_properties(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError
