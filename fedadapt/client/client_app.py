"""Message-API ClientApp: trains the task's model with the chosen optimizer.

Each SuperNode must provide ``partition-id`` and ``num-partitions`` in its
node config (the simulation engine does this automatically; in deployment
pass ``--node-config "partition-id=0 num-partitions=10"``). For Fed-LAMB /
Fed-AMS the server's v̂ arrives, and the client's v leaves, as a second
ArrayRecord named ``second-moments``. A ``query`` message is answered with
the node's ``partition-id`` and ``num-partitions`` (the ServerApp's seeded
sampling orders nodes by them).
"""

from __future__ import annotations

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
    SECOND_MOMENTS_KEY,
    config_number,
    evaluate_round,
    partition_of,
    train_round,
)
from fedadapt.config import validate_run_config

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition; reply with weights and metrics."""
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    config = msg.content.config_records.get("config", ConfigRecord())
    v_hat = None
    if SECOND_MOMENTS_KEY in msg.content.array_records:
        moments = msg.content.array_records[SECOND_MOMENTS_KEY]
        v_hat = {k: v.numpy() for k, v in moments.items()}
    result = train_round(
        cfg,
        pid,
        num,
        msg.content.array_records["arrays"].to_torch_state_dict(),
        lr=config_number(config.get("lr", cfg["client-lr"])),
        server_round=int(config_number(config.get("server-round", 0))),
        v_hat=v_hat,
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(result.state),
            "metrics": MetricRecord(dict(result.metrics)),
        }
    )
    if result.second_moments is not None:
        content[SECOND_MOMENTS_KEY] = ArrayRecord(
            {k: Array(v) for k, v in result.second_moments.items()}
        )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received global model on the local test split."""
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    state = msg.content.array_records["arrays"].to_torch_state_dict()
    metrics = MetricRecord(dict(evaluate_round(cfg, pid, num, state)))
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds (no data is touched)."""
    pid, num = partition_of(context.node_config)
    metrics = MetricRecord({"partition-id": pid, "num-partitions": num})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
