"""ServerApp: Flower's quickstart shape; the strategy import is the only change."""

import os

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

# was: from flwr.serverapp.strategy import FedAvg
from fedadapt.strategies import FedDuA
from plug_in.task import load_centralized_dataset, make_model, test

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
        evaluate_fn=global_evaluate,
    )
    # FedDuA reports its adaptive server step size per round
    for server_round, metrics in sorted(result.evaluate_metrics_clientapp.items()):
        step = strategy.round_reports[server_round]["diagnostics"]["server-lr"]
        central = result.evaluate_metrics_serverapp[server_round]
        print(
            f"round {server_round}: server-lr {step:.4g} "
            f"eval-loss {metrics['eval-loss']:.4f} eval-acc {metrics['eval-acc']:.3f} "
            f"central loss {central['loss']:.4f} accuracy {central['accuracy']:.3f}"
        )

    # Save final model to disk: the model whose metrics were reported last
    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt.tmp")
    os.replace("final_model.pt.tmp", "final_model.pt")  # never half a file


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the global model on the server's own data."""
    model = make_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = test(model, *load_centralized_dataset())
    return MetricRecord({"accuracy": accuracy, "loss": loss})
