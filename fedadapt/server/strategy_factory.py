"""Build the strategy named by run-config ``strategy``, for either Flower API.

The algorithm's declaration (:data:`fedadapt.strategies.ALGORITHMS`) maps its
run-config keys ``<strategy>.<param>`` to ``(rule, options)``: the
framework-free :class:`~fedadapt.strategies.core.ServerRule` and the
adapter's options (``average_last_two``). :func:`build_strategy` puts the
rule into the Message API's :class:`~fedadapt.server.policy.RunStrategy` or
the legacy :class:`~fedadapt.server.policy.LegacyRunStrategy`, with the
sampling arguments of that API, so both ServerApps sample
``clients-per-round`` clients (0: every connected one) with the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedadapt.config import ConfigError
from fedadapt.server.policy import LegacyRunStrategy, RunStrategy
from fedadapt.strategies import ALGORITHMS
from fedadapt.strategies.core import ServerRule
from fedadapt.strategies.secagg import SecAggPlusSettings

StrategySpec = tuple[ServerRule, dict[str, Any]]


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


def trust_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Return the screening options every strategy takes (see ``RuleHost``)."""
    trusting = cfg["secure-aggregation"] == "trust-reported-norms"
    return {
        "secure_aggregation": cfg["secure-aggregation"],
        "max_update_norm": cfg["max-update-norm"],
        # trusted reports: no norm of the server's own, no relative bound;
        # under SecAgg+ the clients clip to the bound the server sends
        "max_update_norm_ratio": 0.0 if trusting else cfg["max-update-norm-ratio"],
        "norm_bound_mode": cfg["norm-bound-mode"],
        "max_weight_ratio": cfg["max-weight-ratio"],
        "max_contribution_ratio": cfg["max-contribution-ratio"],
        # under SecAgg+ a ceiling on the bound the clients clip to
        "max_update_norm_growth": 0.0 if trusting else cfg["max-update-norm-growth"],
        "project_opposing": cfg["project-opposing"],
        "step_guard": cfg["step-guard"],
        "aggregation": cfg["aggregation"].replace("-", "_"),
        "trim_fraction": cfg["trim-fraction"],
        "num_hostile": cfg["num-hostile"],
        "krum_keep": cfg["krum-keep"],
        "clip_radius": cfg["clip-radius"],
        "clip_iterations": cfg["clip-iterations"],
        "max_failed_rounds": cfg["max-failed-rounds"],
        # the screen itself is the ServerApp's validation_loss (validation-size)
        "influence_tolerance": cfg["influence-tolerance"],
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


#: run-config key choosing how federated evaluation reaches the clients
EXCHANGE_KEY = "federated-eval-exchange"


def evaluate_with_train(
    cfg: Mapping[str, Any], deployment: bool, average_last_two: bool = False
) -> bool:
    """Whether federated evaluation rides on the train exchange (one a round).

    Run-config ``federated-eval-exchange``: ``with-train`` yes, ``separate``
    no, ``auto`` in deployment only (a message costs seconds there: a new
    ClientApp process and the grid's polling, docs/benchmarks.md).
    Never without federated evaluation (``clients-per-eval=0``). The
    clients of a method with ``average-last-two`` train from another model
    than the one reported, so folding cannot score it: ``auto`` stays
    separate, ``with-train`` raises ConfigError naming the key.
    """
    mode = cfg[EXCHANGE_KEY]
    if cfg["clients-per-eval"] == 0 or mode == "separate":
        return False
    if average_last_two:
        if mode == "with-train":
            raise ConfigError(
                EXCHANGE_KEY,
                f"with-train scores the model the clients train from, which "
                f"{cfg['strategy']} with average-last-two does not report (it "
                "reports the average of the last two); use separate or auto",
            )
        return False
    return mode == "with-train" or deployment


def build_strategy(
    cfg: Mapping[str, Any],
    num_nodes: int | None = None,
    api: str = "message",
    *,
    deployment: bool = False,
    **extra: Any,
) -> Any:
    """Return the strategy of run-config ``strategy`` for ``api``.

    ``num_nodes`` (connected nodes) is needed by the Message API's sampling;
    ``extra`` goes to the constructor (e.g. legacy ``initial_parameters``,
    ``evaluate_fn``, ``on_fit_config_fn``; the policies of :class:`RunStrategy`
    or :class:`LegacyRunStrategy`). Run-config ``local-update`` picks the
    server half of the clients' local update (``None`` for ``none``); the
    algorithm may add its own (Fed-LAMB's second moments). ``deployment``
    (not a simulation) decides ``federated-eval-exchange=auto``
    (:func:`evaluate_with_train`; the legacy API always evaluates in a
    separate exchange and refuses ``with-train``).
    """
    rule, options = build_rule(cfg)
    kwargs = {**options, **trust_kwargs(cfg), **stop_kwargs(cfg), **extra}
    if cfg["secure-aggregation"] == "secagg+":
        if api != "legacy":
            raise ConfigError(
                "secure-aggregation",
                "secagg+ (also what true means since issue #41) runs through "
                "Flower's legacy API only (Flower has no SecAgg+ for Message-API "
                "strategies): fedadapt's ServerApp runs such runs with the legacy "
                "strategy itself; in your own ServerApp build it with "
                "api='legacy' (fedadapt.server.legacy_app.run); the former meaning "
                'of true is secure-aggregation = "trust-reported-norms"',
            )
        kwargs["secagg"] = secagg_settings(cfg, rule)
    if api == "legacy":
        if cfg[EXCHANGE_KEY] == "with-train" and cfg["clients-per-eval"] > 0:
            raise ConfigError(
                EXCHANGE_KEY,
                "the legacy-API ServerApp evaluates in a separate exchange; use "
                "separate or auto, or the Message-API ServerApp",
            )
        return LegacyRunStrategy(rule, **legacy_sampling_kwargs(cfg), **kwargs)
    assert num_nodes is not None, "the Message API needs the number of nodes"
    kwargs["evaluate_with_train"] = evaluate_with_train(
        cfg, deployment, bool(options.get("average_last_two"))
    )
    return RunStrategy(rule, **sampling_kwargs(cfg, num_nodes), **kwargs)


def secagg_settings(cfg: Mapping[str, Any], rule: ServerRule) -> SecAggPlusSettings:
    """Return the SecAgg+ settings of the run config (``secagg-*`` keys).

    Under uniform weighting every client sends weight 1 and ``max_weight``
    is 1, so no weight is rounded and the error bound is 2c/Q.
    """
    uniform = rule.weighting == "uniform"
    return SecAggPlusSettings(
        clipping_range=cfg["secagg-clipping-range"],
        quantization_range=cfg["secagg-quantization-range"],
        modulus_range=cfg["secagg-modulus-range"],
        max_weight=1.0 if uniform else cfg["secagg-max-weight"],
        num_shares=cfg["secagg-num-shares"],
        reconstruction_threshold=cfg["secagg-reconstruction-threshold"],
        coordinate_bound=cfg["secagg-coordinate-bound"],
        step_guard=cfg["secagg-step-guard"],
    )


def build_rule(cfg: Mapping[str, Any]) -> StrategySpec:
    """Return the rule of run-config ``strategy`` and its adapter options.

    The options' ``local_update`` is the server half the clients' local
    update needs (run-config ``local-update`` and the algorithm's own).
    """
    return ALGORITHMS.get(cfg["strategy"]).from_run_config(cfg)
