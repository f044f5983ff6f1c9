"""ServerApp: Flower's FedAvg, central evaluation, round times to results.json.

results.json has the fields benchmarks/deployment.py reads (as fedadapt's):
``run_id``, ``status`` and per round ``wall_time_s`` and ``replies.used``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from minimal_app.task import build_model, evaluate, load_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg over every connected node; record each round's wall time."""
    cfg = context.run_config
    out = Path(cfg["output-dir"]) / f"minimal-{context.run_id}" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    _, test = load_data(cfg["task"], 0, 1)
    model = build_model(cfg["task"])
    every = cfg["evaluate-every"]
    results = {"run_id": context.run_id, "status": "running", "rounds": []}
    last = [time.monotonic()]

    def central_evaluation(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if every == 0 or server_round % every:
            loss, accuracy = float("nan"), float("nan")
        else:
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, accuracy = evaluate(model, test)
        if server_round > 0:
            now = time.monotonic()
            results["rounds"].append(
                {
                    "round": server_round,
                    "wall_time_s": now - last[0],
                    "replies": {"used": k or len(list(grid.get_node_ids()))},
                    "eval": {"loss": loss, "accuracy": accuracy},
                }
            )
            last[0] = now
            out.write_text(json.dumps(results))
        else:
            last[0] = time.monotonic()
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    # clients-per-round as fedadapt's: k of the nodes (0: all of them)
    nodes = len(list(grid.get_node_ids())) or 1
    k = cfg["clients-per-round"]
    fraction = min(k / nodes, 1.0) if k else 1.0
    FedAvg(
        fraction_train=fraction,
        min_train_nodes=k or 2,
        min_available_nodes=k or 2,
        fraction_evaluate=0.0,
    ).start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=cfg["num-server-rounds"],
        evaluate_fn=central_evaluation,
    )
    results["status"] = "completed"
    out.write_text(json.dumps(results))
