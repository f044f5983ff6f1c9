"""Build the strategy named by run-config ``strategy``.

A registry entry is a factory ``(run_config, num_nodes) -> Strategy`` that
turns run-config keys into constructor arguments; :func:`sampling_kwargs`
gives every strategy the same client sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedadapt import strategies
from fedadapt.config import ConfigError
from fedadapt.registry import Registry

StrategyFactory = Callable[[Mapping[str, Any], int], Strategy]

STRATEGIES: Registry[StrategyFactory] = Registry("strategy")

#: η_g used when run-config ``server-lr`` is 0 (Flower's defaults)
DEFAULT_SERVER_LR = {
    "fedavg": 1.0,
    "fedavgm": 1.0,
    "fedadam": 0.1,
    "fedadagrad": 0.1,
    "fedyogi": 0.01,
}


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


def _common(cfg: Mapping[str, Any], num_nodes: int) -> dict[str, Any]:
    """Return sampling plus the weighting, when the run config overrides it."""
    kwargs = sampling_kwargs(cfg, num_nodes)
    if cfg["weighting"] != "default":
        kwargs["weighting"] = cfg["weighting"].replace("-", "_")
    return kwargs


def server_lr(cfg: Mapping[str, Any], name: str) -> float:
    """Return η_g for strategy ``name`` (run-config ``server-lr``, 0 = default)."""
    lr = float(cfg["server-lr"])
    if name not in DEFAULT_SERVER_LR:
        if lr != 0.0:
            raise ConfigError(
                "server-lr",
                f"{name} sets its own server step size; leave server-lr at 0",
            )
        return 0.0
    if name == "fedavg" and lr not in (0.0, 1.0):
        raise ConfigError(
            "server-lr",
            "fedavg has no server step and requires 0 (default) or 1.0; use fedavgm "
            "for a server learning rate",
        )
    return lr or DEFAULT_SERVER_LR[name]


@STRATEGIES.register("fedavg")
def _fedavg(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    server_lr(cfg, "fedavg")
    return strategies.FedAvg(**_common(cfg, num_nodes))


@STRATEGIES.register("fedavgm")
def _fedavgm(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    return strategies.FedAvgM(
        server_learning_rate=server_lr(cfg, "fedavgm"),
        server_momentum=cfg["server-momentum"],
        **_common(cfg, num_nodes),
    )


@STRATEGIES.register("fedadam")
def _fedadam(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    return strategies.FedAdam(
        eta=server_lr(cfg, "fedadam"),
        eta_l=cfg["client-lr"],
        beta_1=cfg["beta-1"],
        beta_2=cfg["beta-2"],
        tau=cfg["tau"],
        bias_correction=cfg["bias-correction"],
        **_common(cfg, num_nodes),
    )


@STRATEGIES.register("fedadagrad")
def _fedadagrad(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    return strategies.FedAdagrad(
        eta=server_lr(cfg, "fedadagrad"),
        eta_l=cfg["client-lr"],
        tau=cfg["tau"],
        **_common(cfg, num_nodes),
    )


@STRATEGIES.register("fedyogi")
def _fedyogi(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    return strategies.FedYogi(
        eta=server_lr(cfg, "fedyogi"),
        eta_l=cfg["client-lr"],
        beta_1=cfg["beta-1"],
        beta_2=cfg["beta-2"],
        tau=cfg["tau"],
        **_common(cfg, num_nodes),
    )


def _fedexp_family(cfg: Mapping[str, Any], num_nodes: int, name: str) -> Strategy:
    server_lr(cfg, name)
    return strategies.FedExP(
        epsilon=cfg["epsilon-g"],
        server_momentum=cfg["server-momentum"] if name == "fedexpm" else 0.0,
        form=cfg["fedexp-form"],
        average_last_two=cfg["average-last-two"],
        **_common(cfg, num_nodes),
    )


@STRATEGIES.register("fedexp")
def _fedexp(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    return _fedexp_family(cfg, num_nodes, "fedexp")


@STRATEGIES.register("fedexpm")
def _fedexpm(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    return _fedexp_family(cfg, num_nodes, "fedexpm")


@STRATEGIES.register("feddua")
def _feddua(cfg: Mapping[str, Any], num_nodes: int) -> Strategy:
    server_lr(cfg, "feddua")
    return strategies.FedDuA(
        variant=cfg["feddua-variant"],
        beta_1=cfg["beta-1"],
        beta_2=cfg["beta-2"],
        epsilon=cfg["epsilon"],
        epsilon_g=cfg["epsilon-g"],
        average_last_two=cfg["average-last-two"],
        **_common(cfg, num_nodes),
    )
