"""What the default defences cost per aggregation (issue #38).

Times one round of the shared aggregation path
(:func:`fedadapt.strategies.adapter.apply_rule`: statistics and the rule's
step) on 10 replies of a model of ``--params`` float32 parameters in 20
arrays, per strategy, with

- ``off``: no defence (the papers' mean);
- ``before``: the default before issue #38 (flag above 5x the median norm);
- ``clip-wcap-guard``: the default of stops 43–48 (clip to 2x the median
  norm, the weight cap, the step guard);
- ``default``: the default of stops 49–60 (the same, plus the pull cap),
  on the mean;
- ``default+projection``: with the opt-in opposing projection as well;
- ``auto``: today's default, ``default`` on the rule's own aggregator
  (``aggregation="auto"``: multi-Krum for FedAdam, centered clipping for
  FedExP (and FedDuAdagrad), the mean for FedAvg and FedDuAdam);

- ``default+influence`` (with ``--task``): the influence screen as well,
  on ``--validation-size`` examples of the task's training pool (the
  replies are then the task's own model plus the same kind of noise);

interleaved round-robin, the median of ``--repeats`` calls, and prints each
time as a ratio to ``off`` measured in the same run. The replies share a
direction plus noise (norms within 2x of each other except one at 3x, so
the defaults clip one update and the guard runs every round; two point
against the others, so the projection acts on them).

Usage (from the repository root)::

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/defence_cost.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/defence_cost.py --task mnist5k-cnn
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._output import write_json  # noqa: E402
from fedadapt.config import validate_run_config  # noqa: E402
from fedadapt.server.strategy_factory import build_rule  # noqa: E402
from fedadapt.strategies.adapter import apply_rule  # noqa: E402
from fedadapt.strategies.screening import ScreenReport, TrainReply  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {},
    "before": {"max_norm_ratio": 5.0, "clip_mode": "flag"},
    "clip-wcap-guard": {"max_norm_ratio": 2.0, "clip_mode": "clip",
                        "max_weight_ratio": 2.0, "step_guard": True},
    "default": {"max_norm_ratio": 2.0, "clip_mode": "clip",
                "max_weight_ratio": 2.0, "step_guard": True,
                "max_contribution_ratio": 2.0},
    "default+projection": {"max_norm_ratio": 2.0, "clip_mode": "clip",
                           "max_weight_ratio": 2.0, "step_guard": True,
                           "max_contribution_ratio": 2.0, "project_opposing": True},
    "auto": {"max_norm_ratio": 2.0, "clip_mode": "clip",
             "max_weight_ratio": 2.0, "step_guard": True,
             "max_contribution_ratio": 2.0, "aggregation": "auto"},
}  # fmt: skip


def replies(
    params: int, seed: int = 0, model: dict | None = None
) -> tuple[dict, list[TrainReply]]:
    """The global model and 10 honest replies (one at 3x the typical norm).

    ``model``: these arrays as the global model instead of random ones of
    ``params`` parameters.
    """
    rng = np.random.default_rng(seed)
    sizes = [params // 20] * 20
    x = model or {f"layer{i}.weight": rng.normal(size=s).astype(np.float32)
                  for i, s in enumerate(sizes)}  # fmt: skip
    out = []
    shared = {k: rng.normal(size=v.shape) for k, v in x.items()}
    for i in range(10):
        scale = 3.0 if i == 9 else 1.0 + 0.1 * i
        sign = -1.0 if i in (3, 7) else 1.0  # two oppose the others: projected
        arrays = {
            k: (
                v + scale * 0.01 * (sign * shared[k] + rng.normal(size=v.shape))
            ).astype(np.float32)
            for k, v in x.items()
        }
        out.append(TrainReply(i, {"num-examples": 50 + 10 * i}, arrays=arrays))
    return x, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--strategies", default="fedavg,fedadam,fedexp,feddua")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--task", default=None)
    parser.add_argument("--validation-size", type=int, default=200)
    args = parser.parse_args()
    settings = dict(SETTINGS)
    if args.task:
        from fedadapt.server.run import initial_state, server_validation_loss
        from fedadapt.tasks import TASKS

        cfg = validate_run_config(
            {"task": args.task, "validation-size": args.validation_size}
        )
        task = TASKS.get(args.task)
        state = initial_state(task, cfg)
        x, candidates = replies(0, model=state)
        screen = server_validation_loss(task, cfg)
        settings["default+influence"] = {**SETTINGS["default"],
                                         "validation_loss": screen}  # fmt: skip
    else:
        x, candidates = replies(args.params)
    results: dict[str, dict[str, float]] = {}
    for name in args.strategies.split(","):
        # Fed-LAMB's v̂ exchange is not timed here: the model aggregation is
        rule, _ = build_rule(validate_run_config({"strategy": name}))
        times: dict[str, list[float]] = {s: [] for s in settings}
        for repeat in range(args.repeats + 1):
            for setting, options in settings.items():
                fresh = copy.deepcopy(rule)
                report = ScreenReport(received=10, used=10)
                for c in candidates:
                    report.note(c, "used")
                started = time.perf_counter()
                apply_rule(fresh, x, candidates, "num-examples", report, "bench",
                           **options)  # fmt: skip
                if repeat:  # the first call of each is a warm-up
                    times[setting].append(time.perf_counter() - started)
        medians = {s: statistics.median(t) for s, t in times.items()}
        results[name] = medians
        cells = " | ".join(
            f"{s} {medians[s] * 1e3:.1f} ms ({medians[s] / medians['off']:.2f}x)"
            for s in settings
        )
        print(f"| {name} | {cells} |", flush=True)
    if args.json:
        doc = {"params": args.params, "task": args.task, "repeats": args.repeats,
               "validation-size": args.validation_size, "seconds": results}  # fmt: skip
        write_json(args.json, doc)


if __name__ == "__main__":
    main()
