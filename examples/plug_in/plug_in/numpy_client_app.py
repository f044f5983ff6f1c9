"""ClientApp as a legacy NumPyClient: the same training, plus update-sq-norm."""

import numpy as np
import torch
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context

from plug_in.task import load_data, make_model, test, train


def get_weights(model: torch.nn.Module) -> list[np.ndarray]:
    """The model's arrays in state_dict order (the legacy parameter list)."""
    return [v.detach().cpu().numpy() for v in model.state_dict().values()]


def set_weights(model: torch.nn.Module, weights: list[np.ndarray]) -> None:
    """Load a legacy parameter list (state_dict order)."""
    keys = model.state_dict().keys()
    model.load_state_dict(
        {k: torch.from_numpy(np.copy(w)) for k, w in zip(keys, weights, strict=True)}
    )


class PlugInClient(NumPyClient):
    def __init__(self, partition_id: int, num_partitions: int, steps: int) -> None:
        self.model = make_model()
        self.x, self.y = load_data(partition_id, num_partitions)
        self.steps = steps

    def fit(self, parameters, config):
        set_weights(self.model, parameters)
        start = [p.detach().clone() for p in self.model.parameters()]
        loss = train(self.model, self.x, self.y, config["lr"], self.steps)
        # optional: ‖x_i − x_t‖² over the trained arrays (model.parameters(),
        # not buffers); the server checks it against its own value
        sq_norm = sum(
            float(((p.detach() - p0) ** 2).sum())
            for p, p0 in zip(self.model.parameters(), start, strict=True)
        )
        metrics = {"train-loss": loss, "update-sq-norm": sq_norm}
        return get_weights(self.model), len(self.x), metrics

    def evaluate(self, parameters, config):
        set_weights(self.model, parameters)
        loss, acc = test(self.model, self.x, self.y)
        return loss, len(self.x), {"eval-acc": acc}


def client_fn(context: Context):
    return PlugInClient(
        context.node_config["partition-id"],
        context.node_config["num-partitions"],
        context.run_config["local-steps"],
    ).to_client()


app = ClientApp(client_fn=client_fn)
