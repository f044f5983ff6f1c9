"""Message-API ClientApp: trains the task's model with the chosen optimizer.

Each SuperNode provides either ``partition-id`` and ``num-partitions`` in its
node config (a partition of the task's data; the simulation engine does this
automatically; in deployment pass ``--node-config "partition-id=0
num-partitions=10"``), or ``data-path``, its own data on disk
(:mod:`fedadapt.tasks.node_data`: a Hugging Face ``save_to_disk`` folder as
``flwr-datasets create`` writes, an image folder or an npz file), which then
takes precedence. Node data that is missing, unreadable or does not fit the
task fails the node's replies with one line naming the node and the path. When the train
config names a local update (``local-update``,
:mod:`fedadapt.client.local_update`; Fed-LAMB's v̂ and v among them), its
arrays arrive and leave as the ArrayRecord ``local-update-arrays`` and its
client state is kept in the node's ``context.state``. A train config with
``evaluate-first`` (run-config ``federated-eval-exchange``) has the node
evaluate the received model first, as an ``evaluate`` message would, and
send the scores with the trained model. A ``query`` message is
answered with the node's ``partition-id`` and ``num-partitions`` (the
ServerApp's seeded sampling orders nodes by them).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import SType

from fedadapt.client.local import (
    config_number,
    data_path_of,
    evaluate_round,
    partition_of,
    train_round,
)
from fedadapt.config import validate_run_config
from fedadapt.strategies import wire
from fedadapt.strategies.arrays import array_view, dtype_name

app = ClientApp()


def _numpy(record: ArrayRecord | None) -> dict[str, Any] | None:
    return None if record is None else {k: v.numpy() for k, v in record.items()}


@lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """Return the ``.npy`` header ``np.save`` writes for a C-ordered array (cached)."""
    buffer = io.BytesIO()
    empty = np.empty(shape, dtype)
    np.save(buffer, empty, allow_pickle=False)
    return buffer.getvalue()[: buffer.tell() - empty.nbytes]


def _array(values: np.ndarray) -> Array:
    """Flower's ``Array(values)``, the same bytes, with the header written once.

    Flower's ``np.save`` per array formats its header every time (a fifth of
    a millisecond a small model's reply); a model's shapes repeat.
    """
    if not values.flags.c_contiguous or values.dtype.hasobject:
        return Array(values)
    header = _npy_header(values.dtype, values.shape)
    return Array(
        dtype=dtype_name(values.dtype),
        shape=tuple(values.shape),
        stype=SType.NUMPY,
        data=header + values.tobytes(),
    )


def _record(arrays: Mapping[str, Any]) -> ArrayRecord:
    return ArrayRecord({k: _array(v) for k, v in arrays.items()})


def _state_dict(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``'s tensors, without ``np.load`` per array.

    The values are read as views of the bytes (headers parsed once per
    shape, :func:`~fedadapt.strategies.arrays.array_view`) and copied once
    into writable tensors.
    """
    return {k: torch.from_numpy(array_view(v).copy()) for k, v in record.items()}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition; reply with weights and metrics.

    When the train config sets ``evaluate-first`` (federated evaluation
    folded into the train exchange, run-config
    ``federated-eval-exchange``), the received model is first evaluated
    exactly as :func:`evaluate` does, and the scores travel as a second
    MetricRecord, ``evaluate-metrics``, beside the train metrics.
    """
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    records = msg.content.array_records
    config = msg.content.config_records.get(wire.CONFIG, ConfigRecord())
    received = _state_dict(records[wire.ARRAYS])
    scores = None
    if config.get(wire.EVALUATE_FIRST, False):
        scores = _evaluate(cfg, pid, num, received, context)
    result = train_round(
        cfg,
        pid,
        num,
        received,
        lr=config_number(config.get(wire.LR, cfg["client-lr"])),
        server_round=int(config_number(config.get(wire.SERVER_ROUND, 0))),
        config=config,
        local_arrays=_numpy(records.get(wire.LOCAL_ARRAYS)),
        client_state=context.state,
        data_path=data_path_of(context.node_config),
        node_id=context.node_id,
    )
    content = RecordDict(
        {
            wire.ARRAYS: _record({k: v.numpy() for k, v in result.state.items()}),
            wire.METRICS: MetricRecord(dict(result.metrics)),
        }
    )
    if scores is not None:
        content[wire.EVALUATE_METRICS] = scores
    if result.local_arrays is not None:
        content[wire.LOCAL_ARRAYS] = _record(result.local_arrays)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received global model on the local test split."""
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    state = _state_dict(msg.content.array_records[wire.ARRAYS])
    metrics = _evaluate(cfg, pid, num, state, context)
    return Message(content=RecordDict({wire.METRICS: metrics}), reply_to=msg)


def _evaluate(
    cfg: Mapping[str, Any],
    pid: int,
    num: int,
    state: Mapping[str, torch.Tensor],
    context: Context,
) -> MetricRecord:
    """Return this node's evaluation of ``state``: evaluate and folded train."""
    scores = evaluate_round(
        cfg,
        pid,
        num,
        state,
        data_path=data_path_of(context.node_config),
        node_id=context.node_id,
    )
    return MetricRecord(dict(scores))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds (no data is touched).

    A node with its own data (``data-path``) and no ``partition-id`` answers
    without one (it is sampled after the numbered nodes).
    """
    if wire.PARTITION_ID not in context.node_config and data_path_of(
        context.node_config
    ):
        return Message(content=RecordDict({wire.METRICS: MetricRecord()}), reply_to=msg)
    pid, num = partition_of(context.node_config)
    metrics = MetricRecord({wire.PARTITION_ID: pid, wire.NUM_PARTITIONS: num})
    return Message(content=RecordDict({wire.METRICS: metrics}), reply_to=msg)
