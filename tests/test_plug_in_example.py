"""examples/plug_in: an ordinary Flower app that only swaps in FedDuA."""

from __future__ import annotations

import re
import sys
import tomllib

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.e2e
EXAMPLE = ROOT / "examples" / "plug_in"


def test_example_only_changes_the_strategy_import():
    server = (EXAMPLE / "plug_in" / "server_app.py").read_text()
    fedadapt_lines = [line for line in server.splitlines() if "fedadapt" in line]
    assert len(fedadapt_lines) == 1
    assert fedadapt_lines[0].startswith("from fedadapt.strategies import FedDuA")


def test_example_runs_and_learns(capfd, monkeypatch):
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "plug_in" or m.startswith("plug_in.")]:
        monkeypatch.delitem(sys.modules, name)
    from plug_in import client_app, server_app

    run_config = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"][
        "flwr"
    ]["app"]["config"]
    server = ServerApp()

    @server.main()
    def _main(grid, context):
        context.run_config.update(run_config)
        server_app.main(grid, context)

    def _ctx(c):
        return Context(c.run_id, c.node_id, c.node_config, c.state, dict(run_config))

    client = ClientApp()

    @client.train()
    def _train(msg, context):
        return client_app.train_fn(msg, _ctx(context))

    @client.evaluate()
    def _evaluate(msg, context):
        return client_app.evaluate_fn(msg, _ctx(context))

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=3,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False},
        },
    )
    out = capfd.readouterr().out
    losses = [float(v) for v in re.findall(r"eval-loss ([0-9.]+)", out)]
    steps = [float(v) for v in re.findall(r"server-lr ([0-9.eE+-]+)", out)]
    assert len(losses) == run_config["num-server-rounds"], out[-2000:]
    assert losses[-1] < losses[0]
    assert all(s > 0 for s in steps)
