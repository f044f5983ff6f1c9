"""The apps end to end in flwr's in-process run_simulation (Ray backend)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_in_process

pytestmark = pytest.mark.e2e


def test_three_clients_three_rounds_learn(tmp_path):
    run_in_process(
        {
            "output-dir": str(tmp_path),
            "run-name": "inproc",
            "num-server-rounds": 3,
            "clients-per-round": 3,
            "clients-per-eval": 2,
        }
    )
    data = json.loads((tmp_path / "inproc" / "results.json").read_text())
    assert data["status"] == "completed"
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["replies"] == {
            "received": 3, "failed": 0, "rejected": 0, "used": 3, "rejections": []
        }  # fmt: skip
        assert r["evaluate_replies"]["used"] == 2
        assert r["federated_eval"]["eval-loss"] > 0
    test_losses = [data["initial"]["eval"]["loss"]] + [
        r["eval"]["loss"] for r in rounds
    ]
    assert test_losses == sorted(test_losses, reverse=True), test_losses
    assert rounds[-1]["train"]["train-loss"] < rounds[0]["train"]["train-loss"]
    assert (tmp_path / "inproc" / "curves.png").stat().st_size > 5000
