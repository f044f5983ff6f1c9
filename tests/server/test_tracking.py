"""Trackers (issue #32): each round's record read back from the tracker's own files.

Every backend is driven through :class:`RunRecorder` (the path both apps
take) and read back by the tracker's own reader: TensorBoard's
EventAccumulator, MLflow's client on its store, and the W&B offline run's
``.wandb`` transaction log parsed with W&B's protobuf. A backend whose
package is missing skips with the extra to install.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedadapt.config import ConfigError
from fedadapt.server.results import RunRecorder
from fedadapt.server.run import open_recorder
from fedadapt.server.run_folder import RunFolder
from fedadapt.server.tracking import check_tracker, round_metrics

INITIAL = {"loss": 2.5, "accuracy": 0.125}
ROUNDS = [  # (central evaluation, the strategy's report) of rounds 1 and 2
    (
        {"loss": 1.5, "accuracy": 0.5},
        {
            "train": {"train-loss": 1.75, "opt-eta-mean": 0.25},
            "federated_eval": {"eval-loss": 1.625},
            "train_replies": {
                "received": 4, "failed": 1, "rejected": 1, "used": 2,
                "clipped": 1, "rejections": ["node 7: nan"],
            },
            "diagnostics": {"server-lr": 1.875, "mean-update-sq-norm": 0.5},
            "communication": {"sent_bytes": 1000, "sent": {"7": {"arrays": 10}}},
        },
    ),
    (
        {"loss": 1.0, "accuracy": 0.75},
        {
            "train": {"train-loss": 1.25, "opt-eta-mean": 0.375},
            "train_replies": {"received": 4, "failed": 0, "rejected": 0, "used": 4},
            "diagnostics": {"server-lr": 2.5, "mean-update-sq-norm": 0.25},
        },
    ),
]  # fmt: skip


def test_round_metrics_takes_each_groups_numbers_and_nothing_else():
    entry = {
        "round": 1,
        "wall_time_s": 0.5,
        "eval": {"loss": 1.5},
        "federated_eval": None,
        "train": {"train-loss": 1.75, "opt-eta-mean": 0.25},
        "replies": {"used": 2, "failed": 1, "rejections": ["x"], "errors": []},
        "strategy": {"server-lr": 1.875, "norms-trusted": True},
        "communication": {"sent_bytes": 1000, "sent": {"7": {"arrays": 10}}},
        "sampled": {"train": [0, 1]},
    }
    assert round_metrics(entry) == {
        "eval/loss": 1.5,
        "train/train-loss": 1.75,
        "train/opt-eta-mean": 0.25,
        "replies/used": 2.0,
        "replies/failed": 1.0,
        "strategy/server-lr": 1.875,
        "strategy/norms-trusted": 1.0,
        "communication/sent_bytes": 1000.0,
        "time/round_s": 0.5,
    }


def test_missing_package_fails_at_start_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real(name, *a),
    )
    with pytest.raises(ConfigError) as error:
        check_tracker({"tracker": "wandb"})
    assert "pip install 'fedadapt[wandb]'" in str(error.value)
    check_tracker({"tracker": "none"})  # nothing needed


def test_a_failing_tracker_stops_tracking_not_the_run(tmp_path, cfg):
    """A tracker's error mid-run (full disk, locked store) is recorded once."""

    class Failing:
        calls: list[str] = []

        def log_config(self, config):
            self.calls.append("config")

        def log_round(self, step, metrics):
            self.calls.append(f"round {step}")
            raise OSError(28, "No space left on device")

        def close(self, status):
            self.calls.append("close")

    config = cfg(output_dir=str(tmp_path), run_name="r")
    tracker = Failing()
    (tmp_path / "r").mkdir()
    recorder = RunRecorder(tmp_path / "r", config, 1, tracker=tracker)
    for server_round, (scores, report) in enumerate(ROUNDS, start=1):
        recorder.record_round(server_round, 2, scores, report)
    recorder.finish("completed")
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    assert data["status"] == "completed" and len(data["rounds"]) == 2
    assert data["tracker_error"] == "OSError: [Errno 28] No space left on device"
    assert tracker.calls == ["config", "round 1"]  # not called after its error


def _record_run(tmp_path: Path, config: dict) -> dict:
    """Record two rounds through the recorder both apps use; return results.json."""
    folder = RunFolder.claim(tmp_path / config["run-name"], False, "")
    recorder = open_recorder(folder, config, run_id=7)
    recorder.record_initial(INITIAL)
    for server_round, (scores, report) in enumerate(ROUNDS, start=1):
        recorder.record_round(server_round, 2, scores, report)
    recorder.finish("completed")
    data = json.loads((folder.path / "results.json").read_text())
    assert "tracker_error" not in data
    return data


def _expected(data: dict) -> dict[str, list[tuple[int, float]]]:
    """The series every tracker must hold: results.json's, written out here."""
    wall = [r["wall_time_s"] for r in data["rounds"]]
    return {
        "eval/loss": [(0, 2.5), (1, 1.5), (2, 1.0)],
        "eval/accuracy": [(0, 0.125), (1, 0.5), (2, 0.75)],
        "train/train-loss": [(1, 1.75), (2, 1.25)],
        "train/opt-eta-mean": [(1, 0.25), (2, 0.375)],
        "federated_eval/eval-loss": [(1, 1.625)],
        "replies/rejected": [(1, 1.0), (2, 0.0)],
        "replies/clipped": [(1, 1.0)],
        "strategy/server-lr": [(1, 1.875), (2, 2.5)],
        "strategy/mean-update-sq-norm": [(1, 0.5), (2, 0.25)],
        "communication/sent_bytes": [(1, 1000.0)],
        "time/round_s": [(1, wall[0]), (2, wall[1])],
    }


def _assert_series(got: list, expected: list, tag: str) -> None:
    """Same steps, same values (to float32: TensorBoard stores float32)."""
    assert [step for step, _ in got] == [step for step, _ in expected], tag
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_tensorboard_event_files_hold_every_round(tmp_path, cfg):
    pytest.importorskip("tensorboard", reason="pip install 'fedadapt[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    config = cfg(output_dir=str(tmp_path), run_name="r", tracker="tensorboard")
    data = _record_run(tmp_path, config)
    events = EventAccumulator(str(tmp_path / "r" / "tracker" / "r"), size_guidance={})
    events.Reload()
    for tag, series in _expected(data).items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        _assert_series(got, series, tag)
    assert "communication/sent/7/arrays" not in events.Tags()["scalars"]
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0]
    assert b"| strategy | fedavg |" in text


def test_mlflow_store_holds_params_and_every_round(tmp_path, cfg):
    pytest.importorskip("mlflow", reason="pip install 'fedadapt[mlflow]'")
    from mlflow.tracking import MlflowClient

    from fedadapt.server.tracking import mlflow_uri

    shared = tmp_path / "mlruns"
    config = cfg(
        output_dir=str(tmp_path),
        run_name="cell-a",
        tracker="mlflow",
        tracker_dir=str(shared),
        tracker_group="suite-x",
    )
    data = _record_run(tmp_path, config)
    client = MlflowClient(tracking_uri=mlflow_uri(shared))
    experiment = client.get_experiment_by_name("suite-x")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "cell-a" and run.info.status == "FINISHED"
    assert run.data.params["strategy"] == "fedavg"
    assert run.data.params["tracker-group"] == "suite-x"
    assert len(run.data.params) == len(config)  # > 100: batched
    for tag, series in _expected(data).items():
        history = client.get_metric_history(run.info.run_id, tag)
        got = sorted((m.step, m.value) for m in history)
        _assert_series(got, series, tag)


def _wandb_records(path: Path) -> list:
    """Parse a ``.wandb`` file: W&B's header, then LevelDB-log framed protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, payload, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]  # 1 full, 2 first, 3 middle, 4 last
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def test_wandb_offline_run_holds_config_and_every_round(tmp_path, cfg, monkeypatch):
    pytest.importorskip("wandb", reason="pip install 'fedadapt[wandb]'")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    config = cfg(
        output_dir=str(tmp_path), run_name="r", tracker="wandb", tracker_group="g"
    )
    data = _record_run(tmp_path, config)
    (log_file,) = (tmp_path / "r" / "tracker" / "wandb").glob("offline-run-*/*.wandb")
    records = _wandb_records(log_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r, k in zip(records, kinds, strict=True) if k == "run"]
    assert run.display_name == "r" and run.run_group == "g"
    config_items = {
        item.key: json.loads(item.value_json)
        for r, k in zip(records, kinds, strict=True)
        if k == "config"
        for item in r.config.update
    }
    assert config_items["strategy"] == "fedavg"
    got: dict[str, list[tuple[int, float]]] = {}
    for r, k in zip(records, kinds, strict=True):
        if k != "history":
            continue
        row = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for key, value in row.items():
            if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                got.setdefault(key, []).append((row["_step"], value))
    for tag, series in _expected(data).items():
        _assert_series(got[tag], series, tag)
    assert kinds.count("exit") == 1


@pytest.mark.e2e
def test_simulated_run_logs_what_results_json_records(tmp_path):
    """The ServerApp in a Flower simulation: TensorBoard gets every round's record.

    FedExP with Δ-SGD clients: the strategy's η_t and the clients' step-size
    statistics reach TensorBoard exactly as results.json records them.
    """
    pytest.importorskip("tensorboard", reason="pip install 'fedadapt[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    from tests.helpers import run_in_process

    run_in_process(
        {
            "output-dir": str(tmp_path),
            "run-name": "tracked",
            "strategy": "fedexp",
            "client-optimizer": "delta-sgd",
            "num-server-rounds": 2,
            "clients-per-round": 3,
            "tracker": "tensorboard",
            "tracker-dir": str(tmp_path / "tb"),
            "tracker-group": "suite",
        }
    )
    data = json.loads((tmp_path / "tracked" / "results.json").read_text())
    assert data["status"] == "completed" and "tracker_error" not in data
    events = EventAccumulator(str(tmp_path / "tb" / "suite" / "tracked"), {})
    events.Reload()
    expected: dict[str, list[tuple[int, float]]] = {}
    for entry in [{"round": 0, "eval": data["initial"]["eval"]}, *data["rounds"]]:
        for tag, value in round_metrics(entry).items():
            expected.setdefault(tag, []).append((entry["round"], value))
    for tag in ("strategy/server-lr", "train/opt-eta-mean", "replies/used"):
        assert tag in expected, tag  # the run reported what the test checks
    assert [step for step, _ in expected["eval/loss"]] == [0, 1, 2]
    for tag, series in expected.items():
        _assert_series([(e.step, e.value) for e in events.Scalars(tag)], series, tag)
