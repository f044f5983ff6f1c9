"""Message-API ClientApp: trains the task's model with the chosen optimizer.

Each SuperNode must provide ``partition-id`` and ``num-partitions`` in its
node config (the simulation engine does this automatically; in deployment
pass ``--node-config "partition-id=0 num-partitions=10"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedadapt.client.optim import OPTIMIZERS
from fedadapt.client.training import train_local
from fedadapt.config import validate_run_config
from fedadapt.tasks import TASKS, ClientData, Task, evaluate_model, pick_device

app = ClientApp()


def _partition(context: Context) -> tuple[int, int]:
    try:
        pid = int(context.node_config["partition-id"])
        num = int(context.node_config["num-partitions"])
    except KeyError as missing:
        raise ValueError(
            f"node config lacks {missing}; start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        ) from None
    if not 0 <= pid < num:
        raise ValueError(f"partition-id {pid} is outside [0, num-partitions={num})")
    return pid, num


def _setup(msg: Message, context: Context) -> tuple[dict, Task, ClientData, Any]:
    cfg = validate_run_config(context.run_config)
    task = TASKS.get(cfg["task"])
    pid, num = _partition(context)
    data = task.load_client(cfg, pid, num)
    model = task.build_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return cfg, task, data, model


def _reply(msg: Message, content: Mapping[str, Any]) -> Message:
    return Message(content=RecordDict(dict(content)), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition; reply with weights and metrics."""
    cfg, task, data, model = _setup(msg, context)
    config = msg.content["config"]
    server_round = int(config.get("server-round", 0))
    lr = float(config.get("lr", cfg["client-lr"]))
    device = pick_device(cfg["device"])
    model.to(device)
    optimizer = OPTIMIZERS.get(cfg["client-optimizer"])(model.parameters(), lr, cfg)
    pid = int(context.node_config["partition-id"])
    result = train_local(
        model,
        optimizer,
        task.criterion(),
        data.train,
        epochs=cfg["local-epochs"],
        steps=cfg["local-steps"],
        batch_size=cfg["batch-size"],
        seed=cfg["seed"] * 1_000_003 + server_round * 10_007 + pid,
        device=device,
        classification=task.classification,
    )
    metrics = {
        "train-loss": result.loss,
        "num-examples": result.num_examples,
        "update-sq-norm": result.update_sq_norm,
        "local-steps": result.steps,
    }
    if result.accuracy is not None:
        metrics["train-accuracy"] = result.accuracy
    model.to(torch.device("cpu"))
    return _reply(
        msg,
        {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)},
    )


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received global model on the local test split."""
    cfg, task, data, model = _setup(msg, context)
    scores = evaluate_model(
        task, model, data.test, cfg["batch-size"], pick_device(cfg["device"])
    )
    metrics = {f"eval-{k}": v for k, v in scores.items() if k != "num-examples"}
    metrics["num-examples"] = int(scores["num-examples"])
    return _reply(msg, {"metrics": MetricRecord(metrics)})
