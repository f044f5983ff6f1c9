"""Message-API ServerApp: validates the run config, runs the strategy, records.

Everything is chosen by name through run-config (``task``, ``strategy``,
``client-optimizer``, ``partition``); an unknown name or invalid value fails
here, before any node is contacted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedadapt.config import ConfigError, validate_run_config
from fedadapt.registry import lookup
from fedadapt.server.results import RunRecorder, run_directory
from fedadapt.server.strategy_factory import STRATEGIES
from fedadapt.tasks import TASKS, Task, evaluate_model, pick_device

app = ServerApp()

EVAL_BATCH_SIZE = 512


def wait_for_nodes(grid: Grid, wanted: int, timeout: float) -> int:
    """Wait up to ``timeout`` s until ``wanted`` nodes are connected.

    Returns the number of connected nodes; raises ConfigError naming
    ``clients-per-round`` when too few connect in time.
    """
    deadline = time.monotonic() + timeout
    while True:
        connected = len(list(grid.get_node_ids()))
        if connected >= wanted:
            return connected
        if time.monotonic() >= deadline:
            raise ConfigError(
                "clients-per-round",
                f"{wanted} clients per round requested but only {connected} nodes "
                f"connected after {timeout:g}s",
            )
        time.sleep(0.5)


def check_names(cfg: Mapping[str, Any]) -> None:
    """Resolve every registry-backed key now, so a bad name fails at start."""
    for key in ("task", "strategy", "client-optimizer", "partition"):
        lookup(key).get(cfg[key])


def central_evaluator(task: Task, cfg: Mapping[str, Any]):  # noqa: ANN201
    """Return ``arrays -> metrics`` on the task's global test set."""
    test_set = task.load_test(cfg)
    device = pick_device(cfg["device"])
    model = task.build_model()

    def evaluate(arrays: ArrayRecord) -> dict[str, float]:
        model.load_state_dict(arrays.to_torch_state_dict())
        return evaluate_model(task, model, test_set, EVAL_BATCH_SIZE, device)

    return evaluate


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` rounds and write results.json / curves.png."""
    cfg = validate_run_config(context.run_config)
    check_names(cfg)
    task = TASKS.get(cfg["task"])
    num_nodes = wait_for_nodes(grid, cfg["clients-per-round"], cfg["node-wait-timeout"])
    strategy = STRATEGIES.get(cfg["strategy"])(cfg, num_nodes)
    torch.manual_seed(cfg["seed"])
    initial = ArrayRecord(task.build_model().state_dict())
    evaluate = central_evaluator(task, cfg)

    recorder = RunRecorder(run_directory(cfg, context.run_id), cfg, context.run_id)
    log(logging.INFO, "fedadapt: writing results to %s", recorder.run_dir)
    num_rounds = cfg["num-server-rounds"]
    every = cfg["evaluate-every"]

    def on_round_end(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        due = every > 0 and (server_round % every == 0 or server_round == num_rounds)
        scores = evaluate(arrays) if due or (server_round == 0 and every) else None
        if server_round == 0:
            recorder.record_initial(scores)
        else:
            reports = getattr(strategy, "round_reports", {})
            recorder.record_round(
                server_round, num_rounds, scores, reports.get(server_round, {})
            )
        return MetricRecord(scores) if scores else None

    try:
        strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=num_rounds,
            timeout=cfg["round-timeout"],
            train_config=ConfigRecord({"lr": cfg["client-lr"]}),
            evaluate_config=ConfigRecord({}),
            evaluate_fn=on_round_end,
        )
    except BaseException as error:
        recorder.finish("failed", error=repr(error))
        raise
    recorder.finish("completed")
    log(logging.INFO, "fedadapt: results in %s", recorder.run_dir)
