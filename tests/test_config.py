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
from fedadapt.strategies import ALGORITHMS
from tests.helpers import ROOT


def test_defaults_are_valid():
    # client-lr 0 and client-optimizer auto in pyproject.toml stand for the
    # optimizer's and the strategy's defaults
    resolved = {"client-lr": 0.1, "client-optimizer": "sgd"}
    assert validate_run_config({}) == {**defaults(), **resolved}


@pytest.mark.parametrize("strategy", ALGORITHMS.names())
def test_client_optimizer_auto_is_the_strategys_own(strategy):
    """``strategy=fed-lamb`` alone runs (its server needs the clients' second
    moments: Fed-LAMB's client); every other strategy trains with SGD; a
    given optimizer is kept, and a resolved config validates to itself."""
    cfg = validate_run_config({"strategy": strategy})
    expected = "fed-lamb" if strategy == "fed-lamb" else "sgd"
    assert cfg["client-optimizer"] == expected
    assert cfg["client-lr"] == (0.03 if strategy == "fed-lamb" else 0.1)
    assert validate_run_config(cfg) == cfg
    if strategy == "fed-lamb":
        given = {"strategy": strategy, "client-optimizer": "fed-ams"}
        assert validate_run_config(given)["client-optimizer"] == "fed-ams"
    else:
        given = {"strategy": strategy, "client-optimizer": "adam"}
        assert validate_run_config(given)["client-optimizer"] == "adam"


def test_client_lr_0_is_the_client_optimizers_default():
    """Fed-LAMB and Fed-AMS diverge at SGD's 0.1 (issue #38's suite: every
    Fed-LAMB run of mnist5k-cnn at chance); unless given, they train at
    their own rates, and a given rate is kept as it is."""
    lamb = {"strategy": "fed-lamb", "client-optimizer": "fed-lamb"}
    assert validate_run_config(lamb)["client-lr"] == 0.03
    ams = {**lamb, "client-optimizer": "fed-ams"}
    assert validate_run_config(ams)["client-lr"] == 0.0003
    assert validate_run_config({"client-optimizer": "adam"})["client-lr"] == 0.1
    assert validate_run_config({**lamb, "client-lr": 0.1})["client-lr"] == 0.1
    assert validate_run_config({**ams, "client-lr": 0})["client-lr"] == 0.0003
    again = validate_run_config(validate_run_config(lamb))  # results.json's config
    assert again["client-lr"] == 0.03
    with pytest.raises(ConfigError, match="client-lr"):
        validate_run_config({"client-lr": -0.1})


@pytest.mark.parametrize(
    ("overrides", "key", "pattern"),
    [
        ({"bogus-key": 1}, "bogus-key", r"unknown key\. Valid keys: .*batch-size"),
        ({"num-server-rounds": 0}, "num-server-rounds", r"must be >= 1, got 0"),
        ({"num-server-rounds": -3}, "num-server-rounds", r"must be >= 1"),
        ({"num-server-rounds": 2.5}, "num-server-rounds", r"expected an integer"),
        ({"num-server-rounds": True}, "num-server-rounds", r"expected an integer"),
        ({"clients-per-round": -1}, "clients-per-round", r"must be >= 0"),
        ({"client-lr": -0.1}, "client-lr", r"must be >= 0"),
        ({"client-lr": float("nan")}, "client-lr", r"finite"),
        ({"client-lr": "fast"}, "client-lr", r"expected a number"),
        ({"dirichlet-alpha": -1.0}, "dirichlet-alpha", r"must be > 0"),
        ({"client-test-fraction": 0.95}, "client-test-fraction", r"must be <= 0.9"),
        ({"strategy": "fedfoo"}, "strategy",
         r"unknown value 'fedfoo'\. Valid values: fedavg"),
        ({"task": "nope"}, "task", r"Valid values: digits-mlp"),
        ({"client-optimizer": "lion"}, "client-optimizer", r"Valid values: auto, sgd"),
        ({"partition": "x"}, "partition", r"Valid values: iid, dirichlet"),
        ({"device": "tpu"}, "device", r"Valid values: auto, cpu, cuda"),
        ({"output-dir": 3}, "output-dir", r"expected a string"),
        ({"local-epochs": 0, "local-steps": 0}, "local-epochs", r"no local work"),
        ({"clients-per-eval": 2, "client-test-fraction": 0.0}, "clients-per-eval",
         r"local test split"),
        ({"client-optimizer": "fed-lamb"}, "strategy", r"need each other"),
        ({"strategy": "fed-lamb", "client-optimizer": "sgd"}, "strategy",
         r"need each other"),
        ({"local-update": "mime", "client-optimizer": "adam"}, "client-optimizer",
         r"needs client-optimizer in \['sgd'\]; got 'adam'"),
        # the user never named fed-lamb: the message says auto picked it
        ({"strategy": "fed-lamb", "local-update": "mime"}, "client-optimizer",
         r"strategy='fed-lamb' needs its own client optimizer 'fed-lamb' "
         r"\(client-optimizer=auto picked it\)"),
        # asked to withstand 3, in rounds too small for it: not the mean silently
        ({"num-hostile": 3, "clients-per-round": 6}, "num-hostile",
         r"withstands num-hostile=3 in rounds of at least 9 replies, but "
         r"clients-per-round=6: every round would run the plain mean"),
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


def test_auto_takes_small_rounds_where_no_f_was_asked_or_none_is_judged():
    # the default f = 1 in a quickstart's rounds of four: the papers' mean
    assert validate_run_config({"clients-per-round": 4})["num-hostile"] == 1
    # f = 3 in rounds that fit it, or all nodes (their number is not known yet)
    validate_run_config({"num-hostile": 3, "clients-per-round": 9})
    validate_run_config({"num-hostile": 3})
    # under secure aggregation auto is the mean whatever f (f: the quarantine's)
    secure = {"num-hostile": 3, "clients-per-round": 6, "secure-aggregation": "secagg+"}
    assert validate_run_config(secure)["num-hostile"] == 3


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


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("server-lr", ["fedavgm.server-learning-rate", "fedadam.eta", "fedyogi.eta"]),
        ("epsilon-g", ["feddua.epsilon-g", "fedexp.epsilon", "fedexpm.epsilon"]),
        ("feddua-variant", ["feddua.variant"]),
        ("weighting", ["fedavg.weighting", "feddua.weighting"]),
    ],
)
def test_an_old_shared_key_names_its_new_keys(old, new):
    with pytest.raises(ConfigError, match="unknown key") as info:
        validate_run_config({old: 0.5})
    assert info.value.key == old
    for key in new:
        assert key in str(info.value)


def test_another_strategys_key_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="does not read it") as info:
        validate_run_config({"strategy": "fedadam", "feddua.epsilon-g": 0.1})
    assert info.value.key == "feddua.epsilon-g"
    # its default (what Flower passes for every key) is fine
    validate_run_config({"strategy": "fedadam", "feddua.epsilon-g": 0.0})


def _other_value(param):
    """A valid value of ``param`` other than its default (an independent pick)."""
    if isinstance(param.default, bool):
        return not param.default
    if param.choices:
        return next(c for c in param.choices if c != param.default)
    for value in (0.5, 0.25, 0.7, 2.0):
        if value != param.default:
            try:
                return param.check(value)
            except ValueError:
                continue
    raise AssertionError(param)


def _settings(strategy, algorithm):
    rule = strategy.rule
    out = {"repr": repr(rule), "average_last_two": strategy.average_last_two}
    for p in algorithm.params:
        if p.name in algorithm.adapter:
            out[p.name] = getattr(strategy, p.name)
        else:
            out[p.name] = getattr(rule, algorithm.rule_names.get(p.name, p.name))
    return out


@pytest.mark.parametrize("name", ALGORITHMS.names())
@pytest.mark.parametrize("changed", [False, True])
def test_classes_and_app_build_the_declared_settings(cfg, name, changed):
    """For every declared param, the Message-API class, the legacy class and the
    app's factory build rules with identical settings from the same values:
    the declared defaults, or a non-default value for every param at once."""
    from flwr.common import ndarrays_to_parameters

    from fedadapt import strategies
    from fedadapt.strategies import legacy

    algorithm = ALGORITHMS.get(name)
    values = {p.name: (_other_value(p) if changed else p.default)
              for p in algorithm.params}  # fmt: skip
    optimizer = "fed-lamb" if name == "fed-lamb" else "sgd"
    keys = {algorithm.key(n): v for n, v in values.items()}
    config = cfg(strategy=name, client_optimizer=optimizer, **keys)
    app = build_strategy(config, 10)
    app_legacy = build_strategy(
        config, api="legacy", initial_parameters=ndarrays_to_parameters([])
    )
    message = getattr(strategies, algorithm.title)(**values)
    old_api = getattr(legacy, algorithm.title)(**values)
    for strategy in (app, app_legacy, message, old_api):
        got = _settings(strategy, algorithm)
        assert got == _settings(message, algorithm)
        assert {k: got[k] for k in values} == values
    if not changed:  # the classes' own defaults are the declared ones
        assert _settings(getattr(strategies, algorithm.title)(), algorithm) == (
            _settings(message, algorithm)
        )


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_class_signature_and_doc_list_the_declared_params(name):
    import inspect

    from fedadapt import strategies

    algorithm = ALGORITHMS.get(name)
    cls = getattr(strategies, algorithm.title)
    signature = inspect.signature(cls)
    for p in algorithm.params:
        assert signature.parameters[p.name].default == p.default
        assert f"{p.name} : " in cls.__doc__ and p.source in cls.__doc__


def test_every_declared_param_has_a_run_config_key_in_pyproject():
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"
    ]
    for name in ALGORITHMS.names():
        algorithm = ALGORITHMS.get(name)
        for p in algorithm.params:
            assert table[f"{name}.{p.name.replace('_', '-')}"] == p.default


def test_run_config_reaches_the_rules(cfg):
    dua = build_strategy(
        cfg(strategy="feddua", **{"feddua.variant": "adagrad",
            "feddua.epsilon-g": 0.0, "feddua.weighting": "num_examples",
            "feddua.preconditioner": "identity"}), 10
    )  # fmt: skip
    assert (dua.rule.variant, dua.rule.epsilon_g, dua.rule.weighting) == (
        "adagrad", 0.0, "num_examples"
    )  # fmt: skip
    assert dua.rule.preconditioner == "identity"
    expm = build_strategy(
        cfg(strategy="fedexpm", **{"fedexpm.server-momentum": 0.5}), 10
    )
    assert expm.rule.server_momentum == 0.5
    assert build_strategy(cfg(strategy="fedexp"), 10).rule.server_momentum == 0.0
    exp = build_strategy(
        cfg(strategy="fedexp", **{"fedexp.eps-form": "times_S",
                                  "fedexp.eps-decay": 0.5}), 10
    )  # fmt: skip
    assert (exp.rule.eps_form, exp.rule.eps_decay) == ("times_S", 0.5)
    adam = build_strategy(
        cfg(strategy="fedadam", **{"fedadam.eta": 0.02,
                                   "fedadam.bias-correction": "none"}), 10
    )  # fmt: skip
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
