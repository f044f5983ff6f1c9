"""Run-config validation and the generated tables."""

from __future__ import annotations

import re
import tomllib

import pytest

from fedadapt.config import (
    KEYS,
    ConfigError,
    defaults,
    render_markdown_table,
    sync_files,
    validate_run_config,
)
from fedadapt.server.strategy_factory import build_strategy, sampling_kwargs
from tests.helpers import ROOT


def test_defaults_are_valid():
    assert validate_run_config({}) == defaults()


@pytest.mark.parametrize(
    ("overrides", "key", "pattern"),
    [
        ({"bogus-key": 1}, "bogus-key", r"unknown key\. Valid keys: .*batch-size"),
        ({"num-server-rounds": 0}, "num-server-rounds", r"must be >= 1, got 0"),
        ({"num-server-rounds": -3}, "num-server-rounds", r"must be >= 1"),
        ({"num-server-rounds": 2.5}, "num-server-rounds", r"expected an integer"),
        ({"num-server-rounds": True}, "num-server-rounds", r"expected an integer"),
        ({"clients-per-round": -1}, "clients-per-round", r"must be >= 0"),
        ({"client-lr": 0.0}, "client-lr", r"must be > 0"),
        ({"client-lr": float("nan")}, "client-lr", r"finite"),
        ({"client-lr": "fast"}, "client-lr", r"expected a number"),
        ({"dirichlet-alpha": -1.0}, "dirichlet-alpha", r"must be > 0"),
        ({"client-test-fraction": 0.95}, "client-test-fraction", r"must be <= 0.9"),
        ({"strategy": "fedfoo"}, "strategy",
         r"unknown value 'fedfoo'\. Valid values: fedavg"),
        ({"task": "nope"}, "task", r"Valid values: digits-mlp"),
        ({"client-optimizer": "lion"}, "client-optimizer", r"Valid values: sgd"),
        ({"partition": "x"}, "partition", r"Valid values: iid, dirichlet"),
        ({"device": "tpu"}, "device", r"Valid values: auto, cpu, cuda"),
        ({"output-dir": 3}, "output-dir", r"expected a string"),
        ({"local-epochs": 0, "local-steps": 0}, "local-epochs", r"no local work"),
        ({"clients-per-eval": 2, "client-test-fraction": 0.0}, "clients-per-eval",
         r"local test split"),
        ({"client-optimizer": "fed-lamb"}, "strategy", r"need each other"),
        ({"strategy": "fed-lamb"}, "strategy", r"need each other"),
        ({"stop-metric": "accuracy"}, "stop-metric", r"set stop-target or"),
        ({"stop-patience": 3}, "stop-metric", r"need the metric to watch"),
        ({"stop-mode": "up"}, "stop-mode", r"Valid values: max, min"),
        ({"stop-metric": "accuracy", "stop-target": 0.9, "evaluate-every": 0},
         "stop-metric", r"evaluate-every=0 turns off"),
        ({"stop-metric": "eval-loss", "stop-patience": 2}, "stop-metric",
         r"clients-per-eval=0 turns off"),
    ],
)  # fmt: skip
def test_invalid_values_name_the_key(overrides, key, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        validate_run_config(overrides)
    assert info.value.key == key
    assert str(info.value).startswith(f"Invalid run-config '{key}':")


def test_ints_are_accepted_for_float_keys():
    assert validate_run_config({"client-lr": 1})["client-lr"] == 1.0
    assert isinstance(validate_run_config({"client-lr": 1})["client-lr"], float)


def test_more_clients_per_round_than_nodes_is_an_error(cfg):
    with pytest.raises(ConfigError, match=r"'clients-per-round': 10 clients requested"):
        sampling_kwargs(cfg(clients_per_round=10), num_nodes=3)
    with pytest.raises(ConfigError, match=r"'clients-per-eval'"):
        sampling_kwargs(cfg(clients_per_round=2, clients_per_eval=4), num_nodes=3)


@pytest.mark.parametrize("num_nodes", [3, 7, 10, 13, 100])
@pytest.mark.parametrize("wanted", [1, 2, 3])
def test_sampling_gives_exactly_clients_per_round(cfg, num_nodes, wanted):
    # Flower samples max(int(fraction * connected), min_nodes) nodes
    kw = sampling_kwargs(cfg(clients_per_round=wanted), num_nodes)
    assert max(int(num_nodes * kw["fraction_train"]), kw["min_train_nodes"]) == wanted


def test_fedavg_rejects_a_server_learning_rate(cfg):
    with pytest.raises(
        ConfigError, match=r"'server-lr'.*requires 0 \(default\) or 1.0"
    ):
        build_strategy(cfg(server_lr=0.5), 10)
    with pytest.raises(ConfigError, match=r"'server-lr': feddua sets its own"):
        build_strategy(cfg(strategy="feddua", server_lr=0.5), 10)


@pytest.mark.parametrize(
    ("name", "cls", "public"),
    [
        ("fedavg", "FedAvg", {}),
        ("fedavgm", "FedAvgM", {"server_learning_rate": 1.0, "server_momentum": 0.9}),
        ("fedadam", "FedAdam", {"eta": 0.1, "tau": 1e-3}),
        ("fedadagrad", "FedAdagrad", {"eta": 0.1, "tau": 1e-3}),
        ("fedyogi", "FedYogi", {"eta": 0.01}),
        ("fedexp", "FedExP", {}),
        ("fedexpm", "FedExP", {"server_momentum": 0.9}),
        ("feddua", "FedDuA", {"epsilon_g": 1e-3}),
        ("fed-lamb", "FedLAMB", {"eps": 1e-8}),
    ],
)
@pytest.mark.parametrize("api", ["message", "legacy"])
def test_every_strategy_builds_from_run_config(cfg, name, cls, public, api):
    """The factory builds the rule the public class builds with the same
    hyperparameters (run-config defaults), inside either API's adapter."""
    from fedadapt import strategies
    from fedadapt.server.policy import LegacyRunStrategy, RunStrategy
    from fedadapt.strategies import legacy

    optimizer = "fed-lamb" if name == "fed-lamb" else "sgd"
    config = cfg(strategy=name, client_optimizer=optimizer, clients_per_round=4)
    if api == "legacy":
        from flwr.common import ndarrays_to_parameters

        init = ndarrays_to_parameters([])
        strategy = build_strategy(config, api="legacy", initial_parameters=init)
        assert type(strategy) is LegacyRunStrategy
        assert strategy.min_fit_clients == 4
        assert strategy.num_fit_clients(10) == (4, 4)
        expected = getattr(legacy, cls)(**public)
    else:
        strategy = build_strategy(config, 10)
        assert type(strategy) is RunStrategy
        assert strategy.min_train_nodes == 4
        expected = getattr(strategies, cls)(**public)
    assert repr(strategy.rule) == repr(expected.rule)
    assert strategy.average_last_two == expected.average_last_two


def test_run_config_reaches_the_rules(cfg):
    dua = build_strategy(
        cfg(strategy="feddua", feddua_variant="adagrad", epsilon_g=0.0,
            weighting="num-examples"), 10
    )  # fmt: skip
    assert (dua.rule.variant, dua.rule.epsilon_g, dua.rule.weighting) == (
        "adagrad", 0.0, "num_examples"
    )  # fmt: skip
    expm = build_strategy(cfg(strategy="fedexpm", server_momentum=0.5), 10)
    assert expm.rule.server_momentum == 0.5
    assert build_strategy(cfg(strategy="fedexp"), 10).rule.server_momentum == 0.0
    adam = build_strategy(
        cfg(strategy="fedadam", server_lr=0.02, bias_correction="none"), 10
    )
    assert (adam.rule.eta, adam.rule.bias_correction) == (0.02, "none")


def test_pyproject_table_is_generated_from_the_schema():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"] == defaults()
    assert sync_files(ROOT, write=False) == []


def test_readme_lists_every_key():
    readme = (ROOT / "README.md").read_text()
    assert render_markdown_table() in readme
    for name in KEYS:
        assert re.search(rf"\| `{re.escape(name)}` \|", readme), name


def test_paper_setups_are_valid_run_configs():
    import tomllib as toml

    from fedadapt.tasks import TASKS

    for path in sorted((ROOT / "conf" / "tasks").glob("*.toml")):
        overrides = toml.loads(path.read_text())
        cfg = validate_run_config(overrides)
        assert TASKS.get(cfg["task"]).paper_config
        assert path.stem == cfg["task"]


def test_stop_keys_reach_the_strategy_in_both_apis(cfg):
    on = cfg(stop_metric="eval-loss", stop_mode="min", stop_target=0.5,
             stop_patience=4, stop_min_delta=0.01, clients_per_eval=2)  # fmt: skip
    for api in ("message", "legacy"):
        rule = build_strategy(on, 3, api=api).stop_rule
        got = (rule.metric, rule.mode, rule.target, rule.patience, rule.min_delta)
        assert got == ("eval-loss", "min", 0.5, 4, 0.01)
    assert build_strategy(cfg(), 3).stop_rule is None
