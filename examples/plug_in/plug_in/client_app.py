"""ClientApp: plain Flower quickstart code, plus the optional update-sq-norm."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from plug_in.task import load_data, make_model, test, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    x, y = load_data(
        context.node_config["partition-id"], context.node_config["num-partitions"]
    )
    loss = train(
        model, x, y, msg.content["config"]["lr"], context.run_config["local-steps"]
    )
    sq_norm = sum(
        float(((p - p0) ** 2).sum())
        for p, p0 in zip(model.parameters(), start, strict=True)
    )
    metrics = MetricRecord(
        {"train-loss": loss, "num-examples": len(x), "update-sq-norm": sq_norm}
    )
    return Message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}),
        reply_to=msg,
    )


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(
        context.node_config["partition-id"], context.node_config["num-partitions"]
    )
    loss, acc = test(model, x, y)
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": acc, "num-examples": len(x)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
