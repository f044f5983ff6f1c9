"""Cost of per-client records (issue #32): clients.jsonl against results.json.

Every round the recorder appends one line per reply to clients.jsonl (one
write + fsync) and rewrites results.json atomically (write + fsync +
rename). This measures both in the same run, for rounds of 10, 100 and 1000
replies after 100 recorded rounds (results.json grows with the rounds),
median of ``--repeats`` rounds, and prints the ratio.

Usage (from the repository root)::

    .venv/bin/python benchmarks/client_records.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fedadapt.server.client_records import append_round
from fedadapt.server.results import RunRecorder

CFG = {
    "task": "digits-mlp",
    "strategy": "fedavg",
    "client-optimizer": "delta-sgd",
    "run-name": "bench",
    "output-dir": "unused",
}


def reply(round_: int, node: int) -> dict:
    """A screened reply record as large as a Δ-SGD client's."""
    return {
        "round": round_,
        "node": 10**18 + node,
        "status": "used",
        "reason": None,
        "metrics": {
            "num-examples": 500, "train-loss": 0.51, "train-accuracy": 0.87,
            "partition-id": node, "update-sq-norm": 1.23, "local-steps": 8,
            "train-time-s": 0.71, "opt-steps": 8.0, "opt-eta-last": 0.1,
            "opt-eta-mean": 0.1, "opt-eta-min": 0.05, "opt-eta-max": 0.2,
            "opt-growth-fraction": 0.5,
        },
        "reported_sq_norm": 1.23,
        "server_sq_norm": 1.23,
        "norm_mismatch": False,
        "clip_scale": 1.0,
    }  # fmt: skip


def measure(replies: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one round's clients.jsonl append and results.json write."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        recorder = RunRecorder(run, CFG, 1)
        report = {"train_replies": {"received": replies, "used": replies}}
        for r in range(1, 101):  # a run 100 rounds in
            recorder.data["rounds"].append({"round": r, "replies": report})
        append_times, write_times = [], []
        for r in range(101, 101 + repeats):
            records = [reply(r, n) for n in range(replies)]
            started = time.perf_counter()
            append_round(run, records)
            append_times.append(time.perf_counter() - started)
            recorder.data["rounds"].append({"round": r, "replies": report})
            started = time.perf_counter()
            recorder.write()
            write_times.append(time.perf_counter() - started)
        return statistics.median(append_times), statistics.median(write_times)


def main() -> None:
    """Print one row per round size."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print("| replies per round | clients.jsonl append | results.json write | ratio |")
    print("|---|---|---|---|")
    for replies in (10, 100, 1000):
        append, write = measure(replies, args.repeats)
        print(
            f"| {replies} | {append * 1e3:.2f} ms | {write * 1e3:.2f} ms "
            f"| {append / write:.2f} |"
        )


if __name__ == "__main__":
    main()
