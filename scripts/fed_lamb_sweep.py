"""Fed-LAMB / Fed-AMS / Fed-SGD α sweeps in one process, for root-causing.

Drives fedadapt's own client round (``train_round``) and server v̂ rule
(``aggregate_second_moments``) without Flower: each round samples
``--per-round`` of ``--clients`` clients with ``default_rng(seed)``, averages
their models weighted by num-examples (FedAvg) and, for Fed-LAMB / Fed-AMS,
updates v̂ = max(v̂, mean v). A point costs seconds instead of Flower's ~25 s
start-up, so many seeds fit. Sampling differs from the ServerApp's, so
numbers match the suites' in distribution, not digit for digit.

    python scripts/fed_lamb_sweep.py --rounds 30 --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from fedadapt.client.local import train_round
from fedadapt.config import validate_run_config
from fedadapt.server.run import initial_state
from fedadapt.strategies import wire
from fedadapt.strategies.fedlamb import SecondMoments, aggregate_second_moments
from fedadapt.tasks import TASKS, evaluate_model

GRIDS = {
    "fed-lamb": [
        {"strategy": "fed-lamb", "client-optimizer": "fed-lamb", "client-lr": a,
         "fed-lamb-lambda": lam}
        for a in (0.01, 0.03, 0.1, 0.3) for lam in (0.0, 0.01, 0.1)
    ],
    "fed-ams": [{"strategy": "fed-lamb", "client-optimizer": "fed-ams",
                 "client-lr": a} for a in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)],
    "fed-sgd": [{"strategy": "fedavg", "client-optimizer": "sgd", "client-lr": a}
                for a in (0.03, 0.1, 0.3, 1.0)],
}  # fmt: skip


def accuracy_curve(overrides: dict, rounds: int, clients: int, per_round: int):
    """Return the central test accuracy after each round."""
    cfg = validate_run_config(overrides)
    task = TASKS.get(cfg["task"])
    state, test = initial_state(task, cfg), task.load_test(cfg)
    rng = np.random.default_rng(cfg["seed"])
    v_hat, curve = None, []
    for r in range(1, rounds + 1):
        chosen = np.sort(rng.choice(clients, per_round, replace=False))
        config = {wire.LOCAL_UPDATE: SecondMoments.name}  # Fed-LAMB's client half
        if cfg["strategy"] != "fed-lamb":
            config = {}
        outs = [
            train_round(
                cfg,
                int(p),
                clients,
                state,
                cfg["client-lr"],
                r,
                config=config,
                local_arrays=v_hat,
            )
            for p in chosen
        ]
        w = np.array([o.metrics["num-examples"] for o in outs], float)
        w /= w.sum()
        state = {
            k: sum(
                wi * o.state[k].double().numpy() for wi, o in zip(w, outs, strict=True)
            ).astype(v.dtype)
            for k, v in state.items()
        }
        if outs[0].local_arrays is not None:
            v_hat = aggregate_second_moments(v_hat, [o.local_arrays for o in outs])
        model = task.build_model()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        scores = evaluate_model(task, model, test, 256, torch.device("cpu"))
        curve.append(scores["accuracy"])
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits-mlp")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    base = {"task": args.task, "partition": "shards", "classes-per-client": 1,
            "local-epochs": 1, "batch-size": 32}  # fmt: skip
    print(f"| point | mean acc. rounds 8-10 | mean acc. last 3 of {args.rounds} |")
    print("|---|---|---|")
    for method, points in GRIDS.items():
        for point in points:
            curves = np.array([
                accuracy_curve({**base, **point, "seed": s}, args.rounds,
                               args.clients, args.per_round)
                for s in seeds
            ])  # fmt: skip
            label = " ".join(f"{k}={v}" for k, v in point.items()
                             if k not in ("strategy", "client-optimizer"))  # fmt: skip
            print(f"| {method} {label} | {100 * curves[:, 7:10].mean():.1f} | "
                  f"{100 * curves[:, -3:].mean():.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
