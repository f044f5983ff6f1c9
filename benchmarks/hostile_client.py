"""One hostile client among five: test loss after 3 rounds (issue #26 part 3).

Five clients train a real task (``train_round``, the ClientApp's own local
training); one of them sends x_t + FACTOR·Δ_i instead of x_t + Δ_i (its
``update-sq-norm`` honestly computed). The server step is fedadapt's shared
aggregation path (:func:`fedadapt.strategies.adapter.apply_rule`, what
both Flower adapters call) with the rule of run-config ``strategy``.
Printed per strategy: the central test loss after ``--rounds`` rounds of the
honest federation, of the hostile one with the default defence
(``max-update-norm-ratio`` 5: an update above 5x the round's median norm is
scaled down to the median norm of the others), of a client at x4 (below that
bound, so never clipped: about the most a client can weigh undetected), with
the defence off, and
with the robust aggregators, plus the honest runs' largest ratio
max_i ‖Δ_i‖ / median_i ‖Δ_i‖.

Usage (from the repository root)::

    python benchmarks/hostile_client.py --task digits-mlp --rounds 3
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from fedadapt.client.local import train_round
from fedadapt.config import validate_run_config
from fedadapt.server.run import central_evaluator, initial_state
from fedadapt.server.strategy_factory import build_rule
from fedadapt.strategies.adapter import apply_rule
from fedadapt.strategies.screening import ScreenReport, TrainReply
from fedadapt.tasks import TASKS

NUM_CLIENTS = 5
HOSTILE = 2


def run(cfg: dict[str, Any], rounds: int, factor: float, **options: Any) -> tuple:
    """Return (test loss, largest max/median norm ratio, clipped replies)."""
    task = TASKS.get(cfg["task"])
    rule, _ = build_rule(cfg)
    evaluate = central_evaluator(task, cfg)
    x = initial_state(task, cfg)
    ratio, clipped = 0.0, 0
    for server_round in range(1, rounds + 1):
        candidates = []
        for pid in range(NUM_CLIENTS):
            result = train_round(
                cfg, pid, NUM_CLIENTS, x, cfg["client-lr"], server_round
            )
            arrays = {k: v.numpy() for k, v in result.state.items()}
            metrics = dict(result.metrics)
            if pid == HOSTILE and factor != 1.0:
                arrays = {
                    k: (x[k] + factor * (a - x[k])).astype(a.dtype)
                    if a.dtype.kind == "f" else a
                    for k, a in arrays.items()
                }  # fmt: skip
                metrics["update-sq-norm"] *= factor**2
            candidates.append(TrainReply(pid, metrics, arrays=arrays))
        norms = np.sqrt([c.metrics["update-sq-norm"] for c in candidates])
        ratio = max(ratio, float(norms.max() / np.median(norms)))
        report = ScreenReport(received=NUM_CLIENTS, used=NUM_CLIENTS)
        new, _, _ = apply_rule(rule, x, candidates, "num-examples", report,
                               f"round {server_round}", **options)  # fmt: skip
        clipped += report.clipped
        x = new if new is not None else x
    loss = evaluate(x)["loss"]
    return loss, ratio, clipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="digits-mlp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--factor", type=float, default=1e6)
    parser.add_argument("--strategies", default="fedavg,fedadam,fedexp,feddua")
    args = parser.parse_args()
    settings = {
        "honest": (1.0, {"max_norm_ratio": 5.0}),
        "hostile, default (k=5)": (args.factor, {"max_norm_ratio": 5.0}),
        "x4, under the bound": (4.0, {"max_norm_ratio": 5.0}),
        "hostile, defence off": (args.factor, {}),
        "hostile, median": (
            args.factor, {"max_norm_ratio": 5.0, "aggregation": "median"}
        ),
        "hostile, trimmed-mean 0.2": (
            args.factor, {"max_norm_ratio": 5.0, "aggregation": "trimmed_mean"}
        ),
    }  # fmt: skip
    print(
        f"task {args.task}, {NUM_CLIENTS} clients, client {HOSTILE} sends its "
        f"update x{args.factor:g}, test loss after {args.rounds} rounds"
    )
    print("| strategy | " + " | ".join(settings) + " | honest max/median |")
    print("|---" * (len(settings) + 2) + "|")
    for name in args.strategies.split(","):
        cfg = validate_run_config({"task": args.task, "strategy": name})
        cells, spread = [], 0.0
        for label, (factor, options) in settings.items():
            loss, ratio, clipped = run(cfg, args.rounds, factor, **options)
            if label == "honest":
                honest, spread = loss, ratio
                cells.append(f"{loss:.4g} ({clipped} clipped)")
            elif math.isfinite(loss) and loss < 100 * honest:
                cells.append(f"{loss:.4g} ({(loss - honest) / honest:+.1%})")
            else:
                cells.append(f"{loss:.2g}")
        print(f"| {name} | " + " | ".join(cells) + f" | {spread:.2f} |", flush=True)


if __name__ == "__main__":
    main()
