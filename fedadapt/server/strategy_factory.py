"""Build the strategy named by run-config ``strategy``.

A registry entry is a factory ``(run_config, num_nodes) -> Strategy``; it
turns run-config keys into constructor arguments. ``sampling_kwargs`` gives
every strategy the same client sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedadapt.config import ConfigError
from fedadapt.registry import Registry
from fedadapt.strategies import FedAvg

StrategyFactory = Callable[[Mapping[str, Any], int], Strategy]

STRATEGIES: Registry[StrategyFactory] = Registry("strategy")


def sampling_kwargs(cfg: Mapping[str, Any], num_nodes: int) -> dict[str, Any]:
    """Return FedAvg's sampling arguments for exactly ``clients-per-round``.

    Flower samples ``max(int(fraction * connected), min_nodes)`` nodes; with
    ``fraction = k / num_nodes`` and ``min_nodes = k`` that is exactly k.
    """
    train, evaluate = cfg["clients-per-round"], cfg["clients-per-eval"]
    for key, wanted in (("clients-per-round", train), ("clients-per-eval", evaluate)):
        if wanted > num_nodes:
            raise ConfigError(
                key, f"{wanted} clients requested but only {num_nodes} nodes connected"
            )
    return {
        "fraction_train": train / num_nodes,
        "min_train_nodes": train,
        "fraction_evaluate": evaluate / num_nodes,
        "min_evaluate_nodes": evaluate,
        "min_available_nodes": train,
    }


@STRATEGIES.register("fedavg")
def _fedavg(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    if cfg["server-lr"] != 1.0:
        valid = ", ".join(STRATEGIES.names())
        raise ConfigError(
            "server-lr",
            "fedavg has no server step and requires 1.0; pick a strategy with a "
            f"server learning rate (valid strategies: {valid})",
        )
    return FedAvg(**sampling_kwargs(cfg, num_nodes))
