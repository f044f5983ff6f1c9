"""ServerApp of the legacy API (``server_fn``): the strategy import is the change."""

import torch
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

# was: from flwr.server.strategy import FedAvg
from fedadapt.strategies.legacy import FedDuA
from plug_in.numpy_client_app import get_weights
from plug_in.task import make_model


def server_fn(context: Context) -> ServerAppComponents:
    torch.manual_seed(0)
    model = make_model()
    lr = context.run_config["lr"]
    strategy = FedDuA(
        fraction_evaluate=1.0,
        min_available_clients=2,
        initial_parameters=ndarrays_to_parameters(get_weights(model)),
        on_fit_config_fn=lambda server_round: {"lr": lr},
        # the state_dict keys: BatchNorm buffers (had the model any) are then
        # recognised by name and kept out of FedDuA's norms and preconditioner
        array_names=list(model.state_dict()),
    )
    # FedDuA's per-round diagnostics come back as fit metrics "strategy-*"
    # (e.g. strategy-server-lr): Flower's end-of-run summary prints them under
    # "History (metrics, distributed, fit)"; strategy.round_reports has them too
    num_rounds = context.run_config["num-server-rounds"]
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds))


app = ServerApp(server_fn=server_fn)
