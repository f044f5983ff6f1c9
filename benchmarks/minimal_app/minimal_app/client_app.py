"""ClientApp: local SGD steps on this node's partition."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from minimal_app.task import build_model, load_data, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Load the global model, train, send the model back."""
    cfg = context.run_config
    model = build_model(cfg["task"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = "cuda" if cfg["device"] == "cuda" else "cpu"
    model.to(device)
    part = context.node_config["partition-id"], context.node_config["num-partitions"]
    x, y = load_data(cfg["task"], *part, cfg["samples-per-client"])[0]
    data = x.to(device), y.to(device)
    loss = train(
        model,
        data,
        cfg["local-steps"],
        cfg["batch-size"],
        cfg["client-lr"],
        cfg["local-epochs"],
    )
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(y)})
    content = RecordDict(
        {"arrays": ArrayRecord(model.cpu().state_dict()), "metrics": metrics}
    )
    return Message(content=content, reply_to=msg)
