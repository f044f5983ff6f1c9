"""Bytes per client per round (#29 item 4), both APIs, into results.json.

Oracles: the model's size in closed form (NumPy's .npy bytes: 4 bytes per
float32 value plus a 128-byte header per array) and Flower's own
``ConfigRecord.count_bytes`` / ``MetricRecord.count_bytes`` for the scalars.
"""

from __future__ import annotations

import json
from typing import ClassVar

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common import Code, ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager
from torch import nn

from fedadapt.client import client_app
from fedadapt.client.local_update import CLIENT_UPDATES, ClientUpdate, LocalEnd
from fedadapt.server.results import RunRecorder
from fedadapt.strategies import FedAvg, LocalUpdate, wire
from fedadapt.strategies.legacy import FedAvg as LegacyFedAvg
from fedadapt.strategies.traffic import scalar_bytes
from tests.client.harness import Grid, InProcessProxy, global_state, make_contexts

NPY_HEADER = 128  # np.save, format 1.0, for arrays of up to a few dimensions


def _npy_bytes(arrays) -> int:
    """Closed form: the .npy bytes of float32 arrays."""
    return sum(4 * int(np.prod(a.shape)) + NPY_HEADER for a in arrays)


class ControlVariate(LocalUpdate):
    """A SCAFFOLD-shaped test algorithm: c down, one Δc_i per array up."""

    name: ClassVar[str] = "cv"

    def configure(self, server_round, model, num_nodes):
        return {}, {k: np.zeros_like(a) for k, a in model.items()}

    def check_reply(self, arrays, metrics):
        return None if arrays else "expected Δc_i"


class ControlVariateClient(ClientUpdate):
    name: ClassVar[str] = "cv"

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        arrays = {
            n: np.zeros(tuple(p.shape), np.float32) for n, p in model.named_parameters()
        }
        return LocalEnd(arrays=arrays)


@pytest.fixture
def control_variate(monkeypatch):
    monkeypatch.setitem(CLIENT_UPDATES._items, "cv", ControlVariateClient)


def _message_round(local_update):
    contexts = make_contexts(2)
    strategy = FedAvg(
        local_update=local_update, min_train_nodes=2, min_available_nodes=2
    )
    messages = strategy.configure_train(
        1,
        ArrayRecord(global_state()),
        ConfigRecord({wire.LR: 0.1}),
        Grid(list(contexts)),
    )
    replies = [client_app.train(m, contexts[m.metadata.dst_node_id]) for m in messages]
    strategy.aggregate_train(1, replies)
    return strategy.round_reports[1]["communication"], messages, replies


@pytest.mark.usefixtures("task_identity", "control_variate")
@pytest.mark.parametrize("local_update", [None, ControlVariate()])
def test_message_api_records_the_bytes_of_each_node(local_update):
    traffic, messages, replies = _message_round(local_update)
    model = _npy_bytes(global_state().values())
    extra = 0 if local_update is None else model  # c down, Δc_i up: one more model
    assert set(traffic["sent"]) == set(traffic["received"]) == {"1", "2"}
    for message in messages:
        sent = traffic["sent"][str(message.metadata.dst_node_id)]
        assert sent["arrays"] == model + extra
        configs = message.content.config_records.values()
        assert sent["config"] == sum(c.count_bytes() for c in configs) > 0
    for reply in replies:
        received = traffic["received"][str(reply.metadata.src_node_id)]
        assert received["arrays"] == model + extra
        metrics = reply.content.metric_records.values()
        assert received["metrics"] == sum(m.count_bytes() for m in metrics) > 0
    per_node = lambda d: sum(sum(parts.values()) for parts in d.values())  # noqa: E731
    assert traffic["sent_bytes"] == per_node(traffic["sent"])
    assert traffic["received_bytes"] == per_node(traffic["received"])


@pytest.mark.usefixtures("control_variate")
@pytest.mark.parametrize("local_update", [None, ControlVariate()])
def test_legacy_api_records_the_same_bytes(local_update):
    manager = SimpleClientManager()
    for context in make_contexts(2).values():
        manager.register(InProcessProxy(context))
    state = global_state()
    strategy = LegacyFedAvg(
        local_update=local_update,
        array_names=list(state),
        min_fit_clients=2,
        min_available_clients=2,
        on_fit_config_fn=lambda r: {wire.LR: 0.1},
    )
    parameters = ndarrays_to_parameters([v.numpy() for v in state.values()])
    pairs = strategy.configure_fit(1, parameters, manager)
    results = [(p, p.fit(ins, None, None)) for p, ins in pairs]
    assert all(r.status.code == Code.OK for _, r in results)
    strategy.aggregate_fit(1, results, [])
    traffic = strategy.round_reports[1]["communication"]
    model = _npy_bytes(state.values())
    extra = 0 if local_update is None else model
    for proxy, ins in pairs:
        sent = traffic["sent"][proxy.cid]
        assert sent["arrays"] == model + extra
        assert sent["config"] == ConfigRecord(dict(ins.config)).count_bytes()
    for proxy, res in results:
        received = traffic["received"][proxy.cid]
        assert received["arrays"] == model + extra
        # the legacy reply carries num-examples apart: counted as a metric
        metrics = {**res.metrics, wire.NUM_EXAMPLES: res.num_examples}
        assert received["metrics"] == scalar_bytes(metrics)
    assert traffic["sent_bytes"] == 2 * (model + extra) + sum(
        s["config"] for s in traffic["sent"].values()
    )


def test_scalar_bytes_counts_as_flower_does():
    values = {"lr": 0.1, "server-round": 3, "flag": True, "names": '["a", "b"]'}
    assert scalar_bytes(values) == ConfigRecord(values).count_bytes()
    metrics = {"train-loss": 0.5, "num-examples": 10, "v": [1.0, 2.0]}
    assert scalar_bytes(metrics) == MetricRecord(metrics).count_bytes()


def test_results_json_has_the_bytes_per_round_and_their_run_totals(tmp_path):
    recorder = RunRecorder(tmp_path, {"num-server-rounds": 2}, 1)
    for server_round in (1, 2):
        traffic = {
            "sent": {"7": {"arrays": 100, "config": 30}},
            "received": {"7": {"arrays": 100, "metrics": 50}},
            "sent_bytes": 130,
            "received_bytes": 150,
        }
        recorder.record_round(server_round, 2, None, {"communication": traffic})
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["rounds"][1]["communication"]["sent"]["7"]["arrays"] == 100
    assert (data["sent_bytes"], data["received_bytes"]) == (260, 300)


def test_the_model_size_closed_form_is_numpys():
    """The 128-byte header of the closed form, for the shapes of the model."""
    for value in global_state().values():
        array = value.numpy()
        assert array.dtype == np.float32
        assert len(ArrayRecord({"a": torch.as_tensor(array)})["a"].data) == (
            _npy_bytes([array])
        )
