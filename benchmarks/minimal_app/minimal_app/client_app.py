"""ClientApp: local SGD steps on this node's partition."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from minimal_app.task import build_model, load_digits, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Load the global model, train, send the model back."""
    model = build_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    part = context.node_config["partition-id"], context.node_config["num-partitions"]
    data, _ = load_digits(*part)
    cfg = context.run_config
    loss = train(model, data, cfg["local-steps"], cfg["batch-size"], cfg["client-lr"])
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(data[1])})
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}
    )
    return Message(content=content, reply_to=msg)
