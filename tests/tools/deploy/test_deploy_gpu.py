"""The deployment path on a GPU (issue #40 item 5): ``pytest -m gpu``.

SuperLink + SuperNodes as processes (``LocalDeployment``, no Ray), the run
config's ``device='cuda'``; every ClientApp process of every message must
have trained on a CUDA device: clients.jsonl's ``device`` (each reply's own
report, ``train-device``) says so per reply. Skipped where torch sees no
CUDA device; the check done by hand on an H200 is this one command there.
"""

from __future__ import annotations

import json

import pytest

from fedadapt.tools.deploy.local import LocalDeployment
from fedadapt.tools.submission import submit_run
from tests.helpers import ROOT, assert_no_processes_under

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_every_clientapp_of_a_deployment_trains_on_the_gpu(tmp_path):
    rounds, nodes = 2, 2
    workdir = tmp_path / "deploy"
    overrides = {
        "task": "digits-mlp",
        "device": "cuda",
        "num-server-rounds": rounds,
        "clients-per-round": nodes,
        "local-steps": 8,
        "output-dir": str(tmp_path / "out"),
        "run-name": "gpu",
    }
    with LocalDeployment(workdir, nodes) as deployment:
        outcome = submit_run(deployment, ROOT, overrides, nodes, timeout=600)
    assert_no_processes_under(workdir)
    assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
    lines = [
        json.loads(line) for line in (tmp_path / "out" / "gpu" / "clients.jsonl").open()
    ]
    assert len(lines) == rounds * nodes
    assert {line["status"] for line in lines} == {"used"}
    assert all(line["device"].startswith("cuda:") for line in lines), lines
