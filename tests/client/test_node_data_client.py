"""Both client APIs train and evaluate on the node's own data (data-path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict

from fedadapt.client import client_app
from fedadapt.client.numpy_client import FedAdaptClient
from fedadapt.strategies import wire
from fedadapt.tasks import TASKS
from fedadapt.tasks.node_data import NodeDataError

RUN = {"task": "digits-mlp", "local-steps": 2, "batch-size": 4}


def _npz(path, n=25, seed=0):
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.random((n, 64), dtype=np.float32), y=rng.integers(0, 10, n))
    return str(path)


def _params():
    torch.manual_seed(0)
    return [
        v.numpy() for v in TASKS.get("digits-mlp").build_model().state_dict().values()
    ]


def test_numpy_client_uses_the_node_data_and_its_held_out_split(tmp_path):
    client = FedAdaptClient(RUN, {"data-path": _npz(tmp_path / "d.npz")}, node_id=7)
    _, n_train, metrics = client.fit(_params(), {})
    _, n_test, _ = client.evaluate(_params(), {})
    # 25 samples, round(0.2 · 25) = 5 held out
    assert (n_train, n_test) == (20, 5)
    assert client.get_properties({}) == {}  # no partition to name


def test_numpy_client_with_a_bad_path_names_node_and_path(tmp_path):
    client = FedAdaptClient(RUN, {"data-path": str(tmp_path / "x.npz")}, node_id=7)
    with pytest.raises(NodeDataError, match=r"^node 7 data-path .*x\.npz: no such"):
        client.fit(_params(), {})


def test_a_partition_id_still_wins_for_seeded_sampling(tmp_path):
    nodes = {"data-path": _npz(tmp_path / "d.npz"), "partition-id": 2,
             "num-partitions": 3}  # fmt: skip
    client = FedAdaptClient(RUN, nodes)
    assert client.get_properties({})[wire.PARTITION_ID] == 2


@pytest.mark.usefixtures("task_identity")
def test_message_api_query_of_a_data_path_node_names_no_partition(tmp_path):
    context = Context(1, 5, {"data-path": _npz(tmp_path / "d.npz")}, RecordDict(), RUN)
    query = Message(RecordDict(), dst_node_id=5, message_type=MessageType.QUERY)
    reply = client_app.query(query, context)
    assert dict(reply.content[wire.METRICS]) == {}
