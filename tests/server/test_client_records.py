"""Per-client records (clients.jsonl): one line per reply, the server's own norms.

The e2e test runs a short in-process simulation with a lying client (reports
10x its ‖Δ_i‖²) and a hostile one (NaN arrays in round 2). Each client
writes the oracle, ‖x_i − x_t‖² computed in float64 from the arrays it
received and the ones it sends, to a side file; clients.jsonl must hold
exactly one line per reply with the server's norm equal to it.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from fedadapt.server import client_records
from fedadapt.server.client_records import (
    CLIENTS_FILE,
    append_round,
    load_client_records,
    prepare,
    to_dataframe,
)
from fedadapt.server.results import load_client_records as exported_loader

LIAR, HOSTILE, HOSTILE_ROUND = 2, 1, 2


def _record(round_: int, node: int, loss: float = 1.0) -> dict:
    """A screened reply record as RuleHost hands it to the recorder."""
    return {
        "round": round_,
        "node": node,
        "status": "used",
        "reason": None,
        "metrics": {
            "num-examples": 10,
            "train-loss": loss,
            "partition-id": node % 3,
            "opt-eta-mean": 0.5,
            "update-sq-norm": 2.0,
            "local-steps": 3,
        },
        "reported_sq_norm": 2.0,
        "server_sq_norm": 2.0,
        "norm_mismatch": False,
        "clip_scale": 1.0,
    }


def test_flatten_names_the_fields_and_keeps_other_metrics():
    line = client_records.flatten(_record(4, 7, loss=0.25))
    assert line["round"] == 4 and line["node"] == 7 and line["partition"] == 1
    assert line["num_examples"] == 10 and line["train_loss"] == 0.25
    assert line["train_accuracy"] is None  # not sent
    assert line["optimizer"] == {"eta-mean": 0.5}
    assert line["reported_sq_norm"] == 2.0 and line["clipped"] is False
    assert line["local_steps"] == 3 and line["metrics"] == {}
    # what the step guard did to it: null where it did not act
    assert line["a_left_out"] is None and line["step_guard"] is None
    guarded = client_records.flatten({**_record(4, 7), "a_left_out": True})
    assert guarded["a_left_out"] is True


def test_torn_last_line_is_skipped_with_a_warning_and_cut_on_resume(tmp_path):
    append_round(tmp_path, [_record(1, 1), _record(1, 2)])
    append_round(tmp_path, [_record(2, 1)])
    path = tmp_path / CLIENTS_FILE
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[0][:30])  # killed mid-write
    with pytest.warns(RuntimeWarning, match="torn last line"):
        records = load_client_records(tmp_path)
    assert [(r["round"], r["node"]) for r in records] == [(1, 1), (1, 2), (2, 1)]
    # resumed from round 1: round 2 is run again, the torn line goes
    prepare(tmp_path, resumed_from_round=1)
    append_round(tmp_path, [_record(2, 2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = exported_loader(tmp_path)
    assert [(r["round"], r["node"]) for r in records] == [(1, 1), (1, 2), (2, 2)]


def test_a_run_resumed_into_another_folder_takes_the_checkpoints_rounds(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    append_round(old, [_record(1, 1), _record(2, 1), _record(3, 1)])
    prepare(new, resumed_from_round=2, source=old)
    assert [r["round"] for r in load_client_records(new)] == [1, 2]
    assert len(load_client_records(old)) == 3  # the old run's file is left alone


def test_a_broken_middle_line_is_an_error_naming_it(tmp_path):
    (tmp_path / CLIENTS_FILE).write_text('{"round": 1}\nnot json\n{"round": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_client_records(tmp_path)


def test_a_new_run_starts_without_the_old_records(tmp_path):
    append_round(tmp_path, [_record(1, 1)])
    prepare(tmp_path, resumed_from_round=None)
    with pytest.raises(FileNotFoundError, match="no per-client records"):
        load_client_records(tmp_path)


def test_to_dataframe_flattens_or_says_how_to_get_pandas(tmp_path, monkeypatch):
    append_round(tmp_path, [_record(1, 1), _record(1, 2)])
    records = load_client_records(tmp_path)
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pandas"):
            to_dataframe(records)
        return
    frame = to_dataframe(records)
    assert list(frame["node"]) == [1, 2]
    assert list(frame["optimizer.eta-mean"]) == [0.5, 0.5]
    monkeypatch.setitem(__import__("sys").modules, "pandas", None)
    with pytest.raises(ImportError, match="pip install pandas"):
        to_dataframe(records)


def _oracle_train(side: Path):
    """A client train function that lies, turns hostile, and logs the oracle."""
    from flwr.app import Array, ArrayRecord, MetricRecord

    from fedadapt.client import client_app
    from fedadapt.strategies import wire

    def train(msg, context):
        reply = client_app.train(msg, context)
        pid = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"][wire.SERVER_ROUND])
        sent = msg.content["arrays"].to_numpy_ndarrays()
        arrays = reply.content["arrays"]
        names = list(arrays.keys())
        got = arrays.to_numpy_ndarrays()
        oracle = math.fsum(
            float(np.sum((g.astype(np.float64) - s.astype(np.float64)) ** 2))
            for g, s in zip(got, sent, strict=True)
            if g.dtype.kind == "f"
        )
        metrics = dict(reply.content["metrics"])
        if pid == LIAR:
            metrics[wire.UPDATE_SQ_NORM] = 10 * metrics[wire.UPDATE_SQ_NORM]
        if pid == HOSTILE and server_round == HOSTILE_ROUND:
            got = [np.full_like(g, np.nan) if g.dtype.kind == "f" else g for g in got]
            oracle = None
        reply.content["arrays"] = ArrayRecord(
            {n: Array(g) for n, g in zip(names, got, strict=True)}
        )
        reply.content["metrics"] = MetricRecord(metrics)
        line = {"round": server_round, "partition": pid, "sq": oracle}
        with open(side / f"oracle-{pid}-{server_round}.json", "w") as f:
            json.dump(line, f)
        return reply

    return train


@pytest.mark.e2e
def test_every_reply_is_one_line_with_the_servers_norm(tmp_path):
    from tests.helpers import run_in_process

    side = tmp_path / "oracle"
    side.mkdir()
    run_in_process(
        {
            "output-dir": str(tmp_path), "run-name": "clients",
            "num-server-rounds": 3, "clients-per-round": 3, "clients-per-eval": 0,
            "local-steps": 3, "client-optimizer": "delta-sgd",
        },
        client_train=_oracle_train(side),
    )  # fmt: skip
    run = tmp_path / "clients"
    results = json.loads((run / "results.json").read_text())
    records = load_client_records(run)
    oracle = {
        (o["round"], o["partition"]): o["sq"]
        for o in (json.loads(p.read_text()) for p in side.iterdir())
    }
    assert sorted((r["round"], r["partition"]) for r in records) == sorted(oracle)
    for entry in results["rounds"]:  # one line per reply counted in results.json
        lines = [r for r in records if r["round"] == entry["round"]]
        replies = entry["replies"]
        assert len(lines) == replies["received"] == 3
        assert sum(r["status"] == "rejected" for r in lines) == replies["rejected"]
        assert (
            sum(bool(r["norm_mismatch"]) for r in lines) == (replies["norm_mismatches"])
        )
    for r in records:
        key = (r["round"], r["partition"])
        if key == (HOSTILE_ROUND, HOSTILE):
            assert r["status"] == "rejected"
            assert r["reason"] == "arrays contain NaN or Inf"
            assert r["server_sq_norm"] is None
            continue
        assert r["status"] == "used" and r["reason"] is None
        assert r["server_sq_norm"] == pytest.approx(oracle[key], rel=1e-6)
        assert r["norm_mismatch"] is (r["partition"] == LIAR)
        assert r["reported_sq_norm"] == pytest.approx(
            oracle[key] * (10 if r["partition"] == LIAR else 1), rel=1e-3
        )
        assert r["num_examples"] > 0 and r["train_loss"] > 0
        assert 0 <= r["train_accuracy"] <= 1 and r["train_time_s"] > 0
        # the actor's process existed before the message and through training
        assert r["process_age_s"] > r["train_time_s"]
        # where it trained: this run's device, and a Ray actor's node
        assert r["device"] == "cpu"
        assert re.fullmatch(r"[0-9a-f]{12}", r["ray_node"]), r["ray_node"]
        assert r["optimizer"]["steps"] == 3  # Δ-SGD's step-size statistics
        assert r["optimizer"]["eta-min"] <= r["optimizer"]["eta-max"]
        assert r["clipped"] is False
    assert "partition-id" not in results["rounds"][0]["train"]  # never averaged
    assert (run / "clients.png").stat().st_size > 5000


def _lines(signal, values, rounds=6, **extra):
    """clients.jsonl lines: node i reports ``values[i](round)`` as ``signal``."""
    return [
        {"round": r, "node": str(i), "partition": i, "status": "used",
         signal: values[i](r), **extra}
        for r in range(1, rounds + 1) for i in range(len(values))
    ]  # fmt: skip


def test_each_node_is_measured_against_the_others_and_the_honest_range():
    """Oracle: the means and gaps written out (a node's mean beyond the other
    nodes' median, the way that points at a hostile client), and the honest
    maxima of ``SIGNALS`` applied by hand."""
    from fedadapt.server.client_records import SIGNALS, summarize_nodes

    # the trimmed mean cut node 7 at 40 % of its coordinates, the others at
    # 12-15 % (as the suite measured for a sign flip under FedAvgM)
    honest = [lambda r, i=i: 0.12 + 0.01 * ((i + r) % 4) for i in range(10)]
    values = honest[:7] + [lambda r: 0.40] + honest[8:]
    summary = summarize_nodes(_lines("trimmed_share", values))
    by_node = {e["node"]: e for e in summary}
    means = {e["node"]: e["trimmed_share"] for e in summary}
    assert means["7"] == pytest.approx(0.40)
    assert means["0"] == pytest.approx(
        np.mean([0.12 + 0.01 * (r % 4) for r in range(1, 7)])
    )
    others = [m for n, m in means.items() if n != "7"]
    assert by_node["7"]["gaps"]["trimmed_share"] == pytest.approx(
        0.40 - np.median(others)
    )
    assert [e["node"] for e in summary if e["beyond_honest"]] == ["7"]
    assert by_node["7"]["beyond_honest"] == ["trimmed_share"]
    assert by_node["7"]["used"] == 6 and by_node["7"]["center_clip_scale"] is None
    # a share below the others' is no sign, nor a gap within the honest range
    low = honest[:7] + [lambda r: 0.0] + honest[8:]
    assert not any(
        e["beyond_honest"] for e in summarize_nodes(_lines("trimmed_share", low))
    )
    limit = SIGNALS["trimmed_share"][1]
    near = honest[:7] + [lambda r: 0.135 + limit - 0.005] + honest[8:]
    assert not any(
        e["beyond_honest"] for e in summarize_nodes(_lines("trimmed_share", near))
    )
    # multi-Krum left node 3 out in every round, every other node kept: an
    # honest node did so too (SIGNALS), so it is no sign beyond the honest
    kept = [lambda r: True] * 10
    kept[3] = lambda r: False
    summary = summarize_nodes(_lines("selected", kept))
    assert summary[3]["not_selected"] == 1.0
    assert summary[3]["gaps"]["not_selected"] == 1.0
    assert not any(e["beyond_honest"] for e in summary)
    # centered clipping shrinking node 5: low is what points at it
    scales = [lambda r: 0.93] * 10
    scales[5] = lambda r: 0.40
    summary = summarize_nodes(_lines("center_clip_scale", scales))
    assert summary[5]["beyond_honest"] == ["center_clip_scale"]
    assert summary[5]["gaps"]["center_clip_scale"] == pytest.approx(0.53)
    # everyone alike: every gap 0, nobody beyond
    same = summarize_nodes(_lines("center_clip_scale", [lambda r: 0.9] * 10))
    assert all(e["gaps"]["center_clip_scale"] == 0 for e in same)
    assert not any(e["beyond_honest"] for e in same)


def test_fedadapt_clients_prints_the_nodes_and_the_furthest_one(tmp_path, capsys):
    from fedadapt.tools.cli import main

    scales = [lambda r: 0.93] * 10
    scales[2] = lambda r: 0.4
    text = "".join(
        json.dumps(line) + "\n" for line in _lines("center_clip_scale", scales)
    )
    (tmp_path / "clients.jsonl").write_text(text)
    assert main(["clients", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split("\t") == [
        "node", "partition", "replies", "used", "center_clip_scale", "rejected"
    ]  # fmt: skip
    assert (
        "center_clip_scale: node 2 (partition 2) 0.400, +0.530 from the others' "
        "median: beyond the largest gap honest nodes reached in our runs (0.48)"
    ) in out
    assert "rejected: node 0 (partition 0) 0.000, +0.000 from the others' " in out
    assert "hostile, or an honest node whose data differs" in out
    assert main(["clients", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [e["node"] for e in summary if e["beyond_honest"]] == ["2"]
    # a folder without records: a one-line error, not a traceback
    assert main(["clients", str(tmp_path / "none")]) == 2
    assert "no per-client records" in capsys.readouterr().err
    # output-dir, the folder above the run folders: the error names them
    assert main(["clients", str(tmp_path.parent)]) == 2
    error = capsys.readouterr().err
    assert "run folders below it: " in error and tmp_path.name in error


def test_fedadapt_clients_names_a_line_it_cannot_read(tmp_path, capsys):
    """A hand-edited clients.jsonl: a line that is no JSON object, or a
    signal that is no number, is an error naming it, not a traceback."""
    from fedadapt.tools.cli import main

    path = tmp_path / "clients.jsonl"
    path.write_text('{"round": 1, "node": "1", "status": "used"}\n[1, 2]\n')
    assert main(["clients", str(tmp_path)]) == 2
    assert "line 2 is not a JSON object" in capsys.readouterr().err
    path.write_text('{"round": 3, "node": "1", "status": "used", "clip_scale": "x"}\n')
    assert main(["clients", str(tmp_path)]) == 2
    assert "round 3, node 1: clip_scale is not a number: 'x'" in capsys.readouterr().err
