"""results.json / curves.png and the per-round log line."""

from __future__ import annotations

import json

from fedadapt.server.results import RunRecorder, format_round, run_directory


def test_recorder_writes_json_every_round_and_a_png(tmp_path, cfg):
    config = cfg(output_dir=str(tmp_path), run_name="r1")
    run_dir = run_directory(config, run_id=42)
    assert run_dir == tmp_path / "r1"
    recorder = RunRecorder(run_dir, config, run_id=42)
    assert json.loads((run_dir / "results.json").read_text())["status"] == "running"
    recorder.record_initial({"loss": 2.3, "accuracy": 0.1})
    report = {
        "train": {"train-loss": 1.5, "train-accuracy": 0.4},
        "train_replies": {"received": 3, "failed": 1, "rejected": 0, "used": 2},
    }
    recorder.record_round(1, 2, {"loss": 1.2, "accuracy": 0.5}, report)
    mid = json.loads((run_dir / "results.json").read_text())
    assert [r["round"] for r in mid["rounds"]] == [1]
    recorder.record_round(2, 2, {"loss": 1.0, "accuracy": 0.6}, report)
    recorder.finish("completed")
    data = json.loads((run_dir / "results.json").read_text())
    assert data["status"] == "completed" and data["run_id"] == 42
    assert data["config"] == config
    assert [r["eval"]["loss"] for r in data["rounds"]] == [1.2, 1.0]
    assert data["rounds"][0]["replies"]["failed"] == 1
    assert data["rounds"][0]["wall_time_s"] >= 0
    png = (run_dir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_round_line_is_readable():
    entry = {
        "round": 3,
        "wall_time_s": 0.5,
        "train": {"train-loss": 1.25, "train-accuracy": 0.5},
        "eval": {"loss": 1.0, "accuracy": 0.75},
        "replies": {"used": 9, "failed": 1, "rejected": 0},
    }
    assert format_round(entry, 20) == (
        "round 3/20 | train loss 1.2500 acc 0.500 | test loss 1.0000 acc 0.750 | "
        "replies 9 used, 1 failed, 0 rejected | 0.50s"
    )


def test_incremental_text_is_the_full_serialisation(tmp_path) -> None:
    """results.json reuses finished rounds' text (#30): the same bytes as
    serialising everything again, also after the last round is amended
    (a checkpoint entry) and when a resumed run brings earlier rounds."""
    oracle = lambda r: json.dumps(r.data, indent=2, default=str)  # noqa: E731
    previous = {"rounds": [{"round": 1, "eval": {"loss": 0.5}, "x": [1, {"y": 2}]}]}
    recorder = RunRecorder(tmp_path, {"seed": 0}, run_id=7, previous=previous)
    assert recorder.text() == oracle(recorder)
    for rnd in range(2, 6):
        report = {
            "train": {"loss": 1.0 / rnd, "nested": {"a": [rnd, None]}},
            "train_replies": {"used": rnd, "errors": []},
        }
        recorder.record_round(rnd, 5, {"loss": 0.1 * rnd}, report)
        assert recorder.text() == oracle(recorder)
        recorder.data["rounds"][-1]["checkpoint"] = {"bytes": rnd, "seconds": 0.5}
        recorder.write()
        assert (tmp_path / "results.json").read_text() == oracle(recorder)
    recorder.data["rounds"] = recorder.data["rounds"][:2]  # replaced, not amended
    assert recorder.text() == oracle(recorder)
    assert json.loads(recorder.text())["rounds"][1]["round"] == 2
