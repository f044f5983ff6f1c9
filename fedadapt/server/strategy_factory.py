"""Build the strategy named by run-config ``strategy``, for either Flower API.

A registry entry maps the run config to ``(rule, options)``: the
framework-free :class:`~fedadapt.strategies.core.ServerRule` and the
adapter's options (``average_last_two``). :func:`build_strategy` puts the
rule into the Message API's :class:`~fedadapt.server.policy.RunStrategy` or
the legacy :class:`~fedadapt.server.policy.LegacyRunStrategy`, with the
sampling arguments of that API, so both ServerApps sample
``clients-per-round`` clients (0: every connected one) with the same rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fedadapt.config import ConfigError
from fedadapt.registry import Registry
from fedadapt.server.policy import LegacyRunStrategy, RunStrategy
from fedadapt.strategies.core import (
    FedAdagradRule,
    FedAdamRule,
    FedAvgRule,
    FedDuARule,
    FedExPRule,
    FedLAMBRule,
    FedYogiRule,
    ServerRule,
)
from fedadapt.strategies.local_update import build_local_update

StrategySpec = tuple[ServerRule, dict[str, Any]]
StrategyFactory = Callable[[Mapping[str, Any]], StrategySpec]

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
    """Return FedAvg's sampling arguments for ``clients-per-round``.

    Flower samples ``max(int(fraction * connected), min_nodes)`` nodes; with
    ``fraction = k / num_nodes`` and ``min_nodes = k`` that is exactly k.
    ``clients-per-round = 0`` is Flower's own default, fraction 1 with a
    minimum of one node: every connected node, however many there are.
    """
    train, evaluate = cfg["clients-per-round"], cfg["clients-per-eval"]
    for key, wanted in (("clients-per-round", train), ("clients-per-eval", evaluate)):
        if wanted > num_nodes:
            raise ConfigError(
                key, f"{wanted} clients requested but only {num_nodes} nodes connected"
            )
    if train == 0:
        fraction_train, train = 1.0, 1
    else:
        fraction_train = train / num_nodes
    return {
        "fraction_train": fraction_train,
        "min_train_nodes": train,
        "fraction_evaluate": evaluate / num_nodes,
        "min_evaluate_nodes": evaluate,
        "min_available_nodes": train,
    }


def _weighting(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Return the weighting argument when the run config overrides the rule's."""
    if cfg["weighting"] == "default":
        return {}
    return {"weighting": cfg["weighting"].replace("-", "_")}


def trust_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Return the screening options every strategy takes (see ``RuleHost``)."""
    return {
        "secure_aggregation": cfg["secure-aggregation"],
        "max_update_norm": cfg["max-update-norm"],
        # secure aggregation reveals only sums: the relative bound is off there
        "max_update_norm_ratio": 0.0
        if cfg["secure-aggregation"]
        else cfg["max-update-norm-ratio"],
        "aggregation": cfg["aggregation"].replace("-", "_"),
        "trim_fraction": cfg["trim-fraction"],
        "max_failed_rounds": cfg["max-failed-rounds"],
    }


def stop_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Return the stop rule's arguments (``stop-*`` keys; none when off)."""
    if not cfg["stop-metric"]:
        return {}
    return {
        "stop_metric": cfg["stop-metric"],
        "stop_mode": cfg["stop-mode"],
        "stop_target": cfg["stop-target"] or None,  # 0 = off
        "stop_patience": cfg["stop-patience"],
        "stop_min_delta": cfg["stop-min-delta"],
    }


def legacy_sampling_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Legacy FedAvg's sampling arguments for ``clients-per-round``.

    Legacy Flower samples ``max(int(fraction * available), min_clients)``;
    fraction 0 trains on exactly ``min_fit_clients``, fraction 1 with a
    minimum of one (``clients-per-round = 0``) on every client. A zero
    ``fraction_evaluate`` turns federated evaluation off, so a tiny positive
    one is used when ``clients-per-eval > 0``.
    """
    evaluate, train = cfg["clients-per-eval"], cfg["clients-per-round"]
    return {
        "fraction_fit": 0.0 if train else 1.0,
        "min_fit_clients": max(train, 1),
        "fraction_evaluate": 1e-12 if evaluate else 0.0,
        "min_evaluate_clients": evaluate,
        "min_available_clients": max(train, 1),
    }


def build_strategy(
    cfg: Mapping[str, Any],
    num_nodes: int | None = None,
    api: str = "message",
    **extra: Any,
) -> Any:
    """Return the strategy of run-config ``strategy`` for ``api``.

    ``num_nodes`` (connected nodes) is needed by the Message API's sampling;
    ``extra`` goes to the constructor (e.g. legacy ``initial_parameters``,
    ``evaluate_fn``, ``on_fit_config_fn``; the policies of :class:`RunStrategy`
    or :class:`LegacyRunStrategy`). Run-config ``local-update`` picks the
    server half of the clients' local update (``None`` for ``none``).
    """
    rule, options = build_rule(cfg)
    kwargs = {**options, **trust_kwargs(cfg), **stop_kwargs(cfg), **extra}
    kwargs["local_update"] = build_local_update(cfg)
    if api == "legacy":
        return LegacyRunStrategy(rule, **legacy_sampling_kwargs(cfg), **kwargs)
    assert num_nodes is not None, "the Message API needs the number of nodes"
    return RunStrategy(rule, **sampling_kwargs(cfg, num_nodes), **kwargs)


def build_rule(cfg: Mapping[str, Any]) -> StrategySpec:
    """Return the rule of run-config ``strategy`` and its adapter options."""
    return STRATEGIES.get(cfg["strategy"])(cfg)


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
def _fedavg(cfg: Mapping[str, Any]) -> StrategySpec:
    server_lr(cfg, "fedavg")
    return FedAvgRule(**_weighting(cfg)), {}


@STRATEGIES.register("fedavgm")
def _fedavgm(cfg: Mapping[str, Any]) -> StrategySpec:
    rule = FedAvgRule(
        server_lr=server_lr(cfg, "fedavgm"),
        server_momentum=cfg["server-momentum"],
        **_weighting(cfg),
    )
    return rule, {}


@STRATEGIES.register("fedadam")
def _fedadam(cfg: Mapping[str, Any]) -> StrategySpec:
    rule = FedAdamRule(
        eta=server_lr(cfg, "fedadam"),
        beta_1=cfg["beta-1"],
        beta_2=cfg["beta-2"],
        tau=cfg["tau"],
        bias_correction=cfg["bias-correction"],
        **_weighting(cfg),
    )
    return rule, {}


@STRATEGIES.register("fedadagrad")
def _fedadagrad(cfg: Mapping[str, Any]) -> StrategySpec:
    rule = FedAdagradRule(
        eta=server_lr(cfg, "fedadagrad"), tau=cfg["tau"], **_weighting(cfg)
    )
    return rule, {}


@STRATEGIES.register("fedyogi")
def _fedyogi(cfg: Mapping[str, Any]) -> StrategySpec:
    rule = FedYogiRule(
        eta=server_lr(cfg, "fedyogi"),
        beta_1=cfg["beta-1"],
        beta_2=cfg["beta-2"],
        tau=cfg["tau"],
        **_weighting(cfg),
    )
    return rule, {}


def _fedexp_family(cfg: Mapping[str, Any], name: str) -> StrategySpec:
    server_lr(cfg, name)
    rule = FedExPRule(
        epsilon=cfg["epsilon-g"],
        server_momentum=cfg["server-momentum"] if name == "fedexpm" else 0.0,
        form=cfg["fedexp-form"],
        **_weighting(cfg),
    )
    return rule, {"average_last_two": cfg["average-last-two"]}


@STRATEGIES.register("fedexp")
def _fedexp(cfg: Mapping[str, Any]) -> StrategySpec:
    return _fedexp_family(cfg, "fedexp")


@STRATEGIES.register("fedexpm")
def _fedexpm(cfg: Mapping[str, Any]) -> StrategySpec:
    return _fedexp_family(cfg, "fedexpm")


@STRATEGIES.register("feddua")
def _feddua(cfg: Mapping[str, Any]) -> StrategySpec:
    server_lr(cfg, "feddua")
    rule = FedDuARule(
        variant=cfg["feddua-variant"],
        beta_1=cfg["beta-1"],
        beta_2=cfg["beta-2"],
        epsilon=cfg["epsilon"],
        epsilon_g=cfg["epsilon-g"],
        **_weighting(cfg),
    )
    return rule, {"average_last_two": cfg["average-last-two"]}


@STRATEGIES.register("fed-lamb")
def _fed_lamb(cfg: Mapping[str, Any]) -> StrategySpec:
    server_lr(cfg, "fed-lamb")
    return FedLAMBRule(**_weighting(cfg)), {}
