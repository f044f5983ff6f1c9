"""Every declared algorithm on every surface generated from it (#42 item 1).

The oracle is the declaration itself (``ALGORITHMS``, ``LOCAL_UPDATES``):
a new algorithm that is missing from a class, a run-config key, a choice or
a docs table fails here, naming the surface; docs/extending.md lists what
is written by hand.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib

import pytest

from fedadapt import config, strategies
from fedadapt.client.local_update import CLIENT_UPDATES, client_half
from fedadapt.strategies import ALGORITHMS, core, legacy, server_halves
from fedadapt.strategies.local_update import LOCAL_UPDATES, LocalUpdate
from tests.helpers import ROOT

NAMES = ALGORITHMS.names()


def _pyproject_keys() -> set[str]:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(table["tool"]["flwr"]["app"]["config"])


def _section(path: str, begin: str) -> str:
    text = (ROOT / path).read_text()
    return text.split(f"<!-- BEGIN {begin} -->", 1)[1].split("<!-- END", 1)[0]


def test_feddyn_is_declared():
    assert "feddyn" in NAMES  # the worked example of docs/extending.md


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_has_both_classes_and_its_rule(name):
    algorithm = ALGORITHMS.get(name)
    message = getattr(strategies, algorithm.title)
    assert message.algorithm is algorithm, "Message-API class (strategies/__init__)"
    assert algorithm.title in strategies.__all__
    assert legacy.CLASSES[algorithm.title].algorithm is algorithm
    assert algorithm.title in legacy.__all__
    assert getattr(legacy, algorithm.title) is legacy.CLASSES[algorithm.title]
    assert getattr(core, algorithm.rule.__name__) is algorithm.rule, "core._RULES"


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_is_selectable_with_its_keys(name):
    algorithm = ALGORITHMS.get(name)
    assert name in config.KEYS["strategy"].valid_choices()
    declared = {algorithm.key(p) for p in algorithm.params}
    assert declared <= set(config.KEYS)
    assert declared <= _pyproject_keys(), "python -m fedadapt.config --write"
    defaults = {**config.defaults(), "strategy": name}  # its keys' defaults
    rule, options = algorithm.from_run_config(defaults)
    assert isinstance(rule, algorithm.rule)
    own = algorithm.local_update
    if own is not None:  # its client part: server half built, client half found
        assert options["local_update"].name == own.name
        assert client_half(own.name).name == own.name


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_is_in_the_generated_tables(name):
    algorithm = ALGORITHMS.get(name)
    assert algorithm.paper is not None and algorithm.server_step
    table = _section("README.md", "strategies")
    assert f"| `{name}` | `{algorithm.title}` | {algorithm.paper.short} |" in table
    papers = _section("docs/algorithms.md", "papers")
    row = next(line for line in papers.splitlines() if algorithm.paper.full in line)
    assert algorithm.title in row.split("|")[1]
    reference = (ROOT / "docs/strategies-reference.md").read_text()
    assert f"`{algorithm.title}`" in reference


@pytest.mark.parametrize("name", [n for n in LOCAL_UPDATES.names() if n != "none"])
def test_local_update_is_selectable_and_has_both_halves(name):
    update = LOCAL_UPDATES.get(name)
    assert name in config.KEYS["local-update"].valid_choices()
    assert {update.key(p) for p in update.params} <= set(config.KEYS)
    assert update.client_module is not None
    assert client_half(name).name == name
    assert update.paper is not None
    assert update.paper.full in _section("docs/algorithms.md", "papers")


def test_every_server_half_finds_its_client_half():
    halves = server_halves()
    assert {"feddyn", "fed-lamb", "scaffold", "fedprox"} <= set(halves)
    for name in halves:
        assert client_half(name) is CLIENT_UPDATES.get(name)


def test_the_generated_files_are_current():
    assert config.sync_files(ROOT, write=False) == []


def test_a_late_registration_raises_instead_of_being_unselectable():
    """After fedadapt.config built the keys, registering is refused loudly."""
    with pytest.raises(RuntimeError, match="too late"):
        ALGORITHMS.register("late")(ALGORITHMS.get("fedavg"))
    with pytest.raises(RuntimeError, match="too late"):
        LOCAL_UPDATES.register("late")(LocalUpdate)
    assert "late" not in ALGORITHMS.names() + LOCAL_UPDATES.names()


def test_an_algorithm_registered_before_the_config_is_selectable():
    """A project that registers its algorithm (both halves) before importing
    fedadapt.config gets the keys, the choice, both classes and the tables,
    generated; run in a fresh interpreter (registries are per process)."""
    script = textwrap.dedent(
        """
        from typing import ClassVar
        from fedadapt.strategies import ALGORITHMS, Algorithm, Param
        from fedadapt.strategies.declaration import Paper
        from fedadapt.strategies.fedavg import FedAvgRule
        from fedadapt.strategies.local_update import LocalUpdate

        STEP = Param("server_lr", 2.0, "Server step.", "test", low=0.0)

        class Half(LocalUpdate):
            name: ClassVar[str] = "toy"
            params: ClassVar[tuple[Param, ...]] = (STEP,)

            def __init__(self, server_lr=2.0):
                self.server_lr = server_lr

        TOY = Algorithm(
            name="toy", title="Toy", summary="A test algorithm.", rule=FedAvgRule,
            params=(STEP,), local_update=Half,
            paper=Paper("Nobody 2099", "Nobody, *Toy*, 2099"), server_step="x",
        )
        ALGORITHMS.register("toy")(TOY)

        from fedadapt import config, reference
        from fedadapt.server.strategy_factory import build_strategy
        from fedadapt.strategies import legacy

        cfg = config.validate_run_config({"strategy": "toy", "toy.server-lr": 3.0})
        built = build_strategy(cfg, 2)
        assert built.rule.server_lr == 3.0 and built.local_update.server_lr == 3.0
        assert legacy.Toy.algorithm is TOY
        assert "| `toy` | `Toy` | Nobody 2099 | x |" in (
            reference.render_strategies_table()
        )
        assert "Nobody, *Toy*, 2099" in reference.render_papers_table()
        assert '"toy.server-lr" = 2.0' in config.render_pyproject_table()
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
