"""A hostile SuperNode in a real deployment (issue #38, item 4).

Under SecAgg+ the server sees one masked sum, which it cannot take apart,
so a single reply whose clear ``secagg-clipped`` claims a clip refuses the
whole round. A client can claim that every round at no cost; the legacy
strategy's quarantine (``FedAdaptLegacyStrategy._quarantine``) stops
sampling a node it named, so the client costs one round, not the run.
The unit and suite tests check it with simulated clients; here it is real
processes: SuperLink, four SuperNodes, and on the node of partition 0 a
ClientApp that trains honestly and then reports a clip. The app is
fedadapt's own with that one change, shipped in its own FAB.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from fedadapt.tools.deploy.local import LocalDeployment
from fedadapt.tools.submission import submit_run
from tests.helpers import ROOT, assert_no_processes_under

#: The hostile ClientApp: fedadapt's legacy client (the one SecAgg+ runs
#: use), whose fit on partition 0 claims one clipped coordinate
HOSTILE_CLIENTAPP = """\
from flwr.clientapp import ClientApp

from fedadapt.client import numpy_client
from fedadapt.client.legacy_training import FedAdaptClient
from fedadapt.strategies import wire


class FalseClipClient(FedAdaptClient):
    def fit(self, parameters, config):
        arrays, n, metrics = super().fit(parameters, config)
        if self.partition_id == 0 and wire.SECAGG_CLIPPED in metrics:
            metrics[wire.SECAGG_CLIPPED] = 1
        return arrays, n, metrics


def client_fn(context):
    return FalseClipClient(
        context.run_config, context.node_config, context.state, context.node_id
    ).to_client()


app = ClientApp(client_fn=client_fn, mods=numpy_client.MODS)
"""


def hostile_app(into: Path) -> Path:
    """Write an app folder: fedadapt's pyproject with the hostile ClientApp.

    Its FAB holds the hostile module only; the SuperNodes import fedadapt
    from the environment they run in (this checkout's).
    """
    into.mkdir(parents=True)
    text = (ROOT / "pyproject.toml").read_text()
    text, n = re.subn(
        r'^clientapp = ".*"$', 'clientapp = "hostile_clientapp:app"', text, flags=re.M
    )
    assert n == 1
    text, n = re.subn(
        r"^fab-include = \[.*\]$",
        'fab-include = ["hostile_clientapp.py", "LICENSE"]',
        text,
        flags=re.M,
    )
    assert n == 1
    (into / "pyproject.toml").write_text(text)
    (into / "hostile_clientapp.py").write_text(HOSTILE_CLIENTAPP)
    shutil.copy(ROOT / "LICENSE", into / "LICENSE")
    return into


@pytest.mark.e2e
@pytest.mark.deploy
def test_a_false_clip_claim_costs_one_secure_round_then_the_node_is_left_out(
    tmp_path,
):
    workdir = tmp_path / "deploy"
    app = hostile_app(tmp_path / "app")
    with LocalDeployment(workdir, 4) as deployment:
        out = tmp_path / "run"
        config = {
            "task": "digits-mlp",
            "strategy": "fedexp",
            "clients-per-round": 4,
            "num-server-rounds": 3,
            "local-steps": 3,
            "evaluate-every": 1,
            "secure-aggregation": "secagg+",
            "client-worker": "off",  # the FAB's client, not a worker's
            "output-dir": str(out),
        }
        outcome = submit_run(deployment, app, config, 4, timeout=600)
        assert outcome.status == "finished:completed", (outcome.status, outcome.error)
        # the refused round is what the outcome reports; nothing else is
        assert outcome.problems == ["rounds without usable train replies: [1]"]
        data = json.loads(outcome.results.read_text())
        lines = outcome.results.with_name("clients.jsonl").read_text()
        records = [json.loads(line) for line in lines.splitlines()]
    assert_no_processes_under(workdir)
    assert data["status"] == "completed", data.get("error")
    rounds = data["rounds"]
    assert len(rounds) == 3
    hostile = {r["node"] for r in records if r["partition"] == 0}
    assert len(hostile) == 1
    # round 1: the masked sum refused (nothing stepped), the node named
    assert rounds[0]["replies"]["used"] == 0
    assert rounds[0]["secagg_quarantined"] == sorted(hostile)
    assert "left out of later rounds" in rounds[0]["replies"]["problem"]
    # rounds 2 and 3: the three honest nodes only, and their sums used
    for entry in rounds[1:]:
        assert entry["replies"]["used"] == 3
        assert "secagg_quarantined" not in entry
    later = [r for r in records if r["round"] > 1]
    assert {r["partition"] for r in later} == {1, 2, 3}
    assert all(r["status"] == "used" for r in later)
    # round 2 calibrates the bound (round 1's was refused), round 3 steps
    assert rounds[1]["strategy"]["secagg-calibration"] == 1.0
    assert rounds[2]["strategy"]["server-lr"] > 0
    assert rounds[2]["eval"]["loss"] < data["initial"]["eval"]["loss"]
