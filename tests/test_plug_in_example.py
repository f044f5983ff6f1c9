"""examples/plug_in: an ordinary Flower app that only swaps in FedDuA."""

from __future__ import annotations

import re
import sys
import tomllib

import pytest

from tests.helpers import ROOT, run_in_process

pytestmark = pytest.mark.e2e
EXAMPLE = ROOT / "examples" / "plug_in"


def test_example_only_changes_the_strategy_import():
    server = (EXAMPLE / "plug_in" / "server_app.py").read_text()
    fedadapt_lines = [line for line in server.splitlines() if "fedadapt" in line]
    assert len(fedadapt_lines) == 1
    assert fedadapt_lines[0].startswith("from fedadapt.strategies import FedDuA")


def test_example_runs_and_learns(capfd, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "plug_in" or m.startswith("plug_in.")]:
        monkeypatch.delitem(sys.modules, name)
    from plug_in import client_app, server_app

    pyproject = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    run_config = pyproject["tool"]["flwr"]["app"]["config"]
    run_in_process(
        run_config,
        server_main=server_app.main,
        client_train=client_app.train_fn,
        client_evaluate=client_app.evaluate_fn,
    )
    out = capfd.readouterr().out
    losses = [float(v) for v in re.findall(r"eval-loss ([0-9.]+)", out)]
    steps = [float(v) for v in re.findall(r"server-lr ([0-9.eE+-]+)", out)]
    assert len(losses) == run_config["num-server-rounds"], out[-2000:]
    assert losses[-1] < losses[0]
    assert all(s > 0 for s in steps)
