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
client state is kept in the node's ``context.state``. A ``query`` message is
answered with the node's ``partition-id`` and ``num-partitions`` (the
ServerApp's seeded sampling orders nodes by them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

from fedadapt.client.local import (
    config_number,
    data_path_of,
    evaluate_round,
    partition_of,
    train_round,
)
from fedadapt.config import validate_run_config
from fedadapt.strategies import wire

app = ClientApp()


def _numpy(record: ArrayRecord | None) -> dict[str, Any] | None:
    return None if record is None else {k: v.numpy() for k, v in record.items()}


def _record(arrays: Mapping[str, Any]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition; reply with weights and metrics."""
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    records = msg.content.array_records
    config = msg.content.config_records.get(wire.CONFIG, ConfigRecord())
    result = train_round(
        cfg,
        pid,
        num,
        records[wire.ARRAYS].to_torch_state_dict(),
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
            wire.ARRAYS: ArrayRecord(result.state),
            wire.METRICS: MetricRecord(dict(result.metrics)),
        }
    )
    if result.local_arrays is not None:
        content[wire.LOCAL_ARRAYS] = _record(result.local_arrays)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received global model on the local test split."""
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    state = msg.content.array_records[wire.ARRAYS].to_torch_state_dict()
    scores = evaluate_round(
        cfg,
        pid,
        num,
        state,
        data_path=data_path_of(context.node_config),
        node_id=context.node_id,
    )
    metrics = MetricRecord(dict(scores))
    return Message(content=RecordDict({wire.METRICS: metrics}), reply_to=msg)


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
