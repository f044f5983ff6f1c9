"""What a new user meets first: federation size, bad input at start, the FAB.

Unit-level: a fake grid stands for Flower's, Flower's own FAB builder builds
the app, and Flower's own sampling arithmetic checks the sampling arguments.
The real ``flwr run . local`` with Flower's defaults is in test_e2e_flwr_run.
"""

from __future__ import annotations

import io
import logging
import shutil
import zipfile
from pathlib import Path

import pytest

from fedadapt.config import ConfigError
from fedadapt.server import server_app
from fedadapt.server.run import OneLineUserErrors
from fedadapt.server.strategy_factory import legacy_sampling_kwargs, sampling_kwargs
from fedadapt.tasks.datasets import DatasetMissingError
from tests.helpers import ROOT


class GrowingGrid:
    """A grid whose node count follows a script, one entry per look."""

    def __init__(self, counts: list[int]) -> None:
        self.counts, self.looks = counts, 0

    def get_node_ids(self) -> list[int]:
        count = self.counts[min(self.looks, len(self.counts) - 1)]
        self.looks += 1
        return list(range(1, count + 1))


@pytest.fixture
def no_sleep(monkeypatch):
    """Replace the poll's sleep; fail if the wait would go on for long."""
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        assert len(slept) < 100, "still waiting after 100 polls"

    monkeypatch.setattr(server_app.time, "sleep", sleep)
    return slept


@pytest.mark.parametrize("size", [1, 2, 3, 10])
def test_default_takes_every_node_of_any_simulated_federation(no_sleep, size):
    # nodes appear a moment after the ServerApp starts, all at once
    grid = GrowingGrid([0, 0, size])
    assert server_app.wait_for_nodes(grid, 0, 3600.0, simulation=True) == size


def test_a_simulation_too_small_for_the_request_fails_at_once(no_sleep):
    grid = GrowingGrid([0, 3])
    with pytest.raises(ConfigError, match="num-supernodes=5") as error:
        server_app.wait_for_nodes(grid, 5, 3600.0, simulation=True)
    assert error.value.key == "clients-per-round"
    assert "federation has 3 nodes" in str(error.value)
    assert len(no_sleep) <= 3  # not the node-wait-timeout of an hour


def test_a_simulation_is_counted_once_its_nodes_stop_arriving(no_sleep):
    grid = GrowingGrid([0, 4, 9, 9])  # registration seen half-way through
    assert server_app.wait_for_nodes(grid, 9, 3600.0, simulation=True) == 9


def test_a_deployment_waits_for_nodes_that_connect_later(no_sleep):
    grid = GrowingGrid([0, 1, 1, 2, 3])
    assert server_app.wait_for_nodes(grid, 3, 3600.0) == 3
    assert server_app.wait_for_nodes(GrowingGrid([0, 0, 1]), 0, 3600.0) == 1


def test_a_deployment_gives_up_after_node_wait_timeout(monkeypatch):
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(server_app.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(server_app.time, "sleep", lambda s: None)
    with pytest.raises(ConfigError, match="2 nodes connected after 60s"):
        server_app.wait_for_nodes(GrowingGrid([2]), 3, 60.0)


def _flower_sample_size(kwargs: dict, connected: int) -> int:
    """Flower 1.41 FedAvg: max(int(fraction * connected), min_nodes)."""
    from flwr.serverapp.strategy import FedAvg

    strategy = FedAvg(**kwargs)
    return max(int(strategy.fraction_train * connected), strategy.min_train_nodes)


@pytest.mark.parametrize("connected", [1, 2, 7, 100])
def test_clients_per_round_zero_samples_every_connected_node(cfg, connected):
    kwargs = sampling_kwargs(cfg(), num_nodes=connected)
    assert kwargs["min_available_nodes"] == 1
    # nodes that join later are sampled too: the fraction, not a count, decides
    assert _flower_sample_size(kwargs, connected) == connected
    assert _flower_sample_size(kwargs, connected + 5) == connected + 5
    legacy = legacy_sampling_kwargs(cfg())
    assert legacy["fraction_fit"] == 1.0 and legacy["min_available_clients"] == 1


def test_explicit_clients_per_round_samples_exactly_that(cfg):
    kwargs = sampling_kwargs(cfg(clients_per_round=3), num_nodes=10)
    assert _flower_sample_size(kwargs, 10) == 3


def _record(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException as raised:
        exc_info = (type(raised), raised, raised.__traceback__)
    return logging.LogRecord(
        "flwr", logging.ERROR, __file__, 1, "%s raised an exception",
        ("ServerApp",), exc_info,
    )  # fmt: skip


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("strategy", "unknown value 'fedfoo'. Valid values: fedavg"),
        DatasetMissingError("Dataset 'mnist' not found under data-dir '/x'."),
    ],
)
def test_user_errors_are_logged_as_one_line_without_traceback(error):
    record = _record(error)
    assert OneLineUserErrors().filter(record)
    text = logging.Formatter().format(record)
    assert text == f"fedadapt: run failed: {error}"


def test_other_errors_keep_their_traceback():
    record = _record(RuntimeError("a bug"))
    OneLineUserErrors().filter(record)
    text = logging.Formatter().format(record)
    assert "Traceback" in text and "a bug" in text


def test_fab_holds_the_package_only_whatever_lies_around(tmp_path):
    """Flower's own builder, on a copy of the app with what runs leave behind:
    a nested .flwr deeper than Flower's limit of 10 (examples/plug_in run with
    `fedadapt simulate`), outputs and a deploy workdir."""
    from flwr.cli.build import build_fab_from_disk

    app = tmp_path / "app"
    shutil.copytree(
        ROOT,
        app,
        ignore=shutil.ignore_patterns(".git", ".venv", "outputs", ".flwr*", "data"),
    )
    deep = app / "examples/plug_in/.flwr" / "/".join("abcdefghijk") / "state.json"
    deep.parent.mkdir(parents=True)
    deep.write_text("{}")
    for leftover in (".flwr-deploy/run.json", "outputs/x/results.json"):
        (app / leftover).parent.mkdir(parents=True, exist_ok=True)
        (app / leftover).write_text("{}")
    fab = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app)))
    shipped = {n for n in fab.namelist() if n not in (".info/CONTENT",)}
    package = {
        p.relative_to(app).as_posix()
        for p in (app / "fedadapt").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert shipped == package | {"pyproject.toml", "LICENSE"}


def test_readme_links_stay_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "../shared" not in text
    for target in _markdown_links(text):
        if "://" not in target and not target.startswith("#"):
            assert (ROOT / target.split("#")[0]).exists(), target


def _markdown_links(text: str) -> list[str]:
    import re

    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_flower_refusal_is_reported_as_its_message(tmp_path, monkeypatch):
    from fedadapt.tools import submission as cli

    refusal = (
        '{"success": false, "error-message": "Using SuperLink: x\\n\\n'
        "'a/b.json' exceeds the maximum directory depth of 10.\"}"
    )
    monkeypatch.setattr(cli, "flwr", lambda args, env, **kw: refusal)
    monkeypatch.setattr(cli, "write_connection", lambda *a, **k: None)

    class Target:
        flwr_home, address, connection = tmp_path, "127.0.0.1:1", "x"
        root_certificates, simulation = None, True

    with pytest.raises(RuntimeError) as error:
        cli.submit_run(
            Target(), Path("."), {"output-dir": str(tmp_path)}, 2, timeout=10
        )
    message = str(error.value)
    assert message.startswith("Flower refused the run:\nUsing SuperLink: x")
    assert "maximum directory depth of 10." in message
    assert "{" not in message and "error-message" not in message
