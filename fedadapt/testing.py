"""A contributor's harness: test an algorithm exactly against fedadapt's runtime.

An algorithm's test compares what fedadapt computes with a float64
reference written in the test (the algorithm box, step by step). This
module holds what such a test needs besides the reference, for fedadapt's
own tests and for a user's project alike (``from fedadapt.testing import
...``; needs torch, as the clients do):

- :func:`linear_model`: a float64 ``nn.Linear`` with given weights, the
  model whose gradients a reference writes in two lines;
- :func:`make_contexts`: Flower ``Context`` objects of simulated nodes, each
  with its partition and a ``Context.state`` that keeps client state
  between rounds, as a SuperNode does;
- :func:`message_rounds`: rounds of a Message-API strategy against
  fedadapt's ClientApp in process, real Flower messages and records but no
  Flower loop (:class:`Grid` stands for the SuperLink);
  :func:`legacy_rounds` the same for a legacy strategy against fedadapt's
  NumPyClient (:class:`InProcessProxy`);
- :func:`task_identity`: the run identity Flower sets inside a run, which
  building a ``Message`` outside one needs (a context manager; pytest:
  ``with task_identity(): ...`` or a fixture around it).

docs/extending.md shows them in use (FedDyn's tests,
``tests/client/test_feddyn.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import (
    Code,
    DisconnectRes,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    Parameters,
    ReconnectIns,
    Status,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from torch import nn

from fedadapt.client import client_app, numpy_client
from fedadapt.strategies import wire
from fedadapt.strategies.identity import task_identity

__all__ = [
    "Grid",
    "InProcessProxy",
    "legacy_rounds",
    "linear_model",
    "make_contexts",
    "message_rounds",
    "task_identity",
]


def linear_model(w: np.ndarray, b: np.ndarray) -> nn.Linear:
    """Return a float64 ``nn.Linear`` with weight ``w`` (out × in) and bias ``b``.

    In float64 a reference in NumPy agrees with torch to ~1e-12, so a test
    can compare step by step with ``rtol=1e-12``.
    """
    model = nn.Linear(w.shape[1], w.shape[0]).double()
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(np.asarray(w, dtype=np.float64)))
        model.bias.copy_(torch.from_numpy(np.asarray(b, dtype=np.float64)))
    return model


class Grid:
    """What a Message-API strategy asks of Flower's grid: the connected nodes."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> list[int]:
        """Return the node ids (N, the federation's client count)."""
        return list(self.nodes)


def make_contexts(num: int, run_config: Mapping[str, Any]) -> dict[int, Context]:
    """Return nodes 1..num with partitions 0..num−1, each with ``run_config``.

    The run config is the ClientApp's (``task``, ``local-steps``, …; keys
    left out take their defaults). Each context keeps its own
    ``Context.state``, where a client half's state lives between rounds.
    """
    return {
        node: Context(
            1,
            node,
            {wire.PARTITION_ID: node - 1, wire.NUM_PARTITIONS: num},
            RecordDict(),
            dict(run_config),
        )
        for node in range(1, num + 1)
    }


def message_rounds(
    strategy: Any,
    contexts: Mapping[int, Context],
    rounds: int,
    arrays: ArrayRecord,
    *,
    first: int = 1,
    lr: float = 0.1,
    messages_hook: Callable[[int, list[Message]], None] | None = None,
    replies_hook: Callable[[list[Message]], None] | None = None,
) -> list[tuple[Any, dict[str, Any]]]:
    """Run ``rounds`` rounds: strategy ↔ fedadapt's ClientApp, no Flower loop.

    Round ``first`` trains from ``arrays``; each later one from the model
    the strategy returned (kept when it returned none). Every round's train
    config carries the client learning rate ``lr``. ``messages_hook(round,
    messages)`` sees each round's train messages before the clients do
    (who was sampled: ``m.metadata.dst_node_id``), ``replies_hook(replies)``
    the replies before the strategy does (to alter them). Returns each
    round's (train metrics, ``strategy.round_reports[round]``).
    """
    reports = []
    for server_round in range(first, first + rounds):
        messages = list(
            strategy.configure_train(
                server_round,
                arrays,
                ConfigRecord({wire.LR: lr}),
                Grid(list(contexts)),
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

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        """Train with fedadapt's NumPyClient on this node's context."""
        client = numpy_client.client_fn(self.context)
        return client.fit(ins)

    def get_properties(
        self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None
    ) -> GetPropertiesRes:
        """Report no properties."""
        return GetPropertiesRes(Status(Code.OK, ""), {})

    def get_parameters(
        self, ins: GetParametersIns, timeout: float | None, group_id: int | None
    ) -> GetParametersRes:
        """Not used by the strategies (the server holds the model)."""
        raise NotImplementedError

    def evaluate(
        self, ins: EvaluateIns, timeout: float | None, group_id: int | None
    ) -> EvaluateRes:
        """Not used by :func:`legacy_rounds` (training only)."""
        raise NotImplementedError

    def reconnect(
        self, ins: ReconnectIns, timeout: float | None, group_id: int | None
    ) -> DisconnectRes:
        """Nothing to reconnect in process."""
        return DisconnectRes("")


def legacy_rounds(
    strategy: Any,
    contexts: Mapping[int, Context],
    rounds: int,
    parameters: Parameters,
    *,
    first: int = 1,
    sampled_hook: Callable[[int, list[int]], None] | None = None,
) -> tuple[Parameters, list[dict[str, Any]]]:
    """Run ``rounds`` legacy rounds: strategy ↔ fedadapt's NumPyClient.

    Every node of ``contexts`` is registered with a Flower
    ``SimpleClientManager`` (N = its size); the strategy samples and
    configures as in a run (its ``on_fit_config_fn`` sets the client
    learning rate), the clients train in process. ``sampled_hook(round,
    node_ids)`` sees who was sampled. Returns the last parameters and each
    round's ``strategy.round_reports[round]``.
    """
    manager = SimpleClientManager()
    for context in contexts.values():
        manager.register(InProcessProxy(context))
    reports = []
    for server_round in range(first, first + rounds):
        pairs = strategy.configure_fit(server_round, parameters, manager)
        if sampled_hook is not None:
            sampled_hook(server_round, [proxy.context.node_id for proxy, _ in pairs])
        results = [(proxy, proxy.fit(ins, None, None)) for proxy, ins in pairs]
        new, _ = strategy.aggregate_fit(server_round, results, [])
        parameters = new if new is not None else parameters
        reports.append(strategy.round_reports[server_round])
    return parameters, reports
