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


def test_example_runs_learns_and_saves_the_model_it_reported(
    capfd, monkeypatch, tmp_path
):
    """Issue #27: final_model.pt scores exactly what the last round reported.

    Evaluated here on the server's data (central, as the example's
    ``global_evaluate``) and on each client's data (federated, as its
    ``evaluate_fn``), the saved model gives the last round's reported
    metrics; with FedDuA's ``average_last_two`` that holds only if the saved
    ``Result.arrays`` is the evaluated average, not the iterate w_{t+1}.
    """
    import torch

    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "plug_in" or m.startswith("plug_in.")]:
        monkeypatch.delitem(sys.modules, name)
    from plug_in import client_app, server_app, task

    results = []

    class Recorded(server_app.FedDuA):  # the example's strategy, result kept
        def start(self, *args, **kwargs):
            results.append(super().start(*args, **kwargs))
            return results[-1]

    monkeypatch.setattr(server_app, "FedDuA", Recorded)
    monkeypatch.chdir(tmp_path)  # the example saves to its working directory
    pyproject = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    run_config = pyproject["tool"]["flwr"]["app"]["config"]
    num_nodes = 3
    run_in_process(
        run_config,
        num_supernodes=num_nodes,
        server_main=server_app.main,
        client_train=client_app.train_fn,
        client_evaluate=client_app.evaluate_fn,
    )
    out = capfd.readouterr().out
    losses = [float(v) for v in re.findall(r"eval-loss ([0-9.]+)", out)]
    steps = [float(v) for v in re.findall(r"server-lr ([0-9.eE+-]+)", out)]
    num_rounds = run_config["num-server-rounds"]
    assert len(losses) == num_rounds, out[-2000:]
    assert losses[-1] < losses[0]
    assert all(s > 0 for s in steps)

    (result,) = results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final_model.pt"]
    model = task.make_model()
    model.load_state_dict(torch.load(tmp_path / "final_model.pt"))
    loss, accuracy = task.test(model, *task.load_centralized_dataset())
    central = result.evaluate_metrics_serverapp[num_rounds]
    assert (loss, accuracy) == (central["loss"], central["accuracy"])
    # each client's own evaluation of the saved model, averaged by num-examples
    # (equal: 200 each) as Flower's evaluate aggregation does
    clients = [task.test(model, *task.load_data(i, num_nodes)) for i in range(3)]
    federated = result.evaluate_metrics_clientapp[num_rounds]
    assert federated["eval-loss"] == pytest.approx(
        sum(c[0] for c in clients) / num_nodes, rel=1e-12
    )
    assert federated["eval-acc"] == pytest.approx(
        sum(c[1] for c in clients) / num_nodes, rel=1e-12
    )


def test_legacy_variant_reports_diagnostics_and_consistent_norms(caplog, monkeypatch):
    """NumPyClient + server_fn: strategy-* fit metrics, no norm mismatch."""
    from flwr.app import Context
    from flwr.client import ClientApp
    from flwr.server import ServerApp
    from flwr.simulation import run_simulation

    from tests.helpers import BACKEND_CONFIG

    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "plug_in" or m.startswith("plug_in.")]:
        monkeypatch.delitem(sys.modules, name)
    from plug_in import legacy_server_app, numpy_client_app

    server = (EXAMPLE / "plug_in" / "legacy_server_app.py").read_text()
    imports = [
        line for line in server.splitlines() if "import" in line and "fedadapt" in line
    ]
    assert imports == ["from fedadapt.strategies.legacy import FedDuA"]
    pyproject = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    run_config = dict(pyproject["tool"]["flwr"]["app"]["config"])

    def server_fn(context: Context):  # run_simulation ignores pyproject.toml
        context.run_config.update(run_config)
        return legacy_server_app.server_fn(context)

    def client_fn(c: Context):
        return numpy_client_app.client_fn(
            Context(c.run_id, c.node_id, c.node_config, c.state, run_config)
        )

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=3,
        backend_config=BACKEND_CONFIG,
    )
    out = caplog.text  # Flower's log
    assert "History (metrics, distributed, fit)" in out, out[-3000:]
    steps = re.findall(r"'strategy-server-lr': \[([^\]]*)\]", out)
    assert steps, out[-3000:]
    rounds = re.findall(r"\((\d+), ([0-9.eE+-]+)\)", steps[0])
    assert [int(r) for r, _ in rounds] == list(
        range(1, run_config["num-server-rounds"] + 1)
    )
    assert all(float(v) > 0 for _, v in rounds)
    # the client's norm over model.parameters() is the server's own
    assert "reported update-sq-norm" not in out
