"""ServerApp: Flower's quickstart shape; the strategy import is the only change."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

# was: from flwr.serverapp.strategy import FedAvg
from fedadapt.strategies import FedDuA
from plug_in.task import make_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.manual_seed(0)
    strategy = FedDuA(fraction_evaluate=1.0, min_available_nodes=2)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_model().state_dict()),
        num_rounds=context.run_config["num-server-rounds"],
        train_config=ConfigRecord({"lr": context.run_config["lr"]}),
    )
    # FedDuA reports its adaptive server step size per round
    for server_round, metrics in sorted(result.evaluate_metrics_clientapp.items()):
        step = strategy.round_reports[server_round]["diagnostics"]["server-lr"]
        print(
            f"round {server_round}: server-lr {step:.4g} "
            f"eval-loss {metrics['eval-loss']:.4f} eval-acc {metrics['eval-acc']:.3f}"
        )
