"""How far Fed-AMS's first local steps go, with and without v's bias correction.

Issue #38's suite found Fed-AMS at chance on mnist5k-cnn at α ≥ 1e-3 in
every run (``fedadapt.config.OPTIMIZER_CLIENT_LR``). Our reading: Fed-AMS
(LAMB Algorithm 1's Local AMSGrad) bias-corrects m but not v, so its
first step is α·ĝ/√((1−β2)·g²) ≈ α/√(1−β2) ≈ 32·α in every coordinate,
shrinking as v fills (α/√(1−β2^t)). This measures it on client 0's data of
the run config (default: mnist5k-cnn at the app's defaults, seed 0), in
round 1 (v̂ = ε: nothing shared yet): per step t, the mean |Δθ| per
coordinate as a multiple of α, for ``FedAMS`` as the app builds it and with
``bias_correction_v=True`` (torch's ``Adam(amsgrad=True)``, the baseline:
steps of about α). Prints a table and writes JSON.

With ``--seeds N`` it also runs the attack suite's honest cells (Fed-LAMB's
server, Fed-AMS clients at α, N seeds, 10 rounds) once as the app builds
Fed-AMS and once with v bias-corrected: whether those first steps are what
sends the run to chance.

    OMP_NUM_THREADS=1 python benchmarks/fed_ams_first_steps.py --seeds 3 \
        --out benchmarks/results/fed-ams-first-steps.json
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._output import write_json  # noqa: E402
from fedadapt.config import validate_run_config  # noqa: E402
from fedadapt.optimizers import FedAMS  # noqa: E402
from fedadapt.tasks import TASKS  # noqa: E402
from fedadapt.tasks.base import batch_loader  # noqa: E402

#: the suite's federation (benchmarks/attacks.py)
NUM_CLIENTS = 10
#: the local steps reported (one local epoch of client 0 is about 12)
REPORTED = (1, 2, 3, 5, 10, 20, 50, 100)


def step_multiples(cfg: dict, correct_v: bool, steps: int) -> list[float]:
    """Mean |Δθ| / α per coordinate for each of ``steps`` local steps."""
    task = TASKS.get(cfg["task"])
    torch.manual_seed(cfg["seed"])
    model = task.build_model()
    lr = cfg["client-lr"]
    optimizer = FedAMS(model.parameters(), lr=lr, bias_correction_v=correct_v)
    data = task.load_client(cfg, 0, NUM_CLIENTS).train
    criterion = task.criterion()
    multiples: list[float] = []
    while len(multiples) < steps:
        for x, y in batch_loader(data, cfg["batch-size"], shuffle=True):
            before = torch.cat(
                [p.detach().flatten().clone() for p in model.parameters()]
            )
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            after = torch.cat([p.detach().flatten() for p in model.parameters()])
            multiples.append(float((after - before).abs().mean()) / lr)
            if len(multiples) == steps:
                break
    return multiples


def honest_accuracy(task: str, lr: float, seeds: int, correct_v: bool) -> list[float]:
    """The suite's honest Fed-LAMB + Fed-AMS runs, one final accuracy per seed."""
    spec = importlib.util.spec_from_file_location(
        "attack_suite", Path(__file__).with_name("attacks.py")
    )
    suite = importlib.util.module_from_spec(spec)
    sys.modules["attack_suite"] = suite
    spec.loader.exec_module(suite)
    defence = f"ams-{lr:g}"
    original = FedAMS.__init__

    def init(self: FedAMS, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("bias_correction_v", correct_v)  # the app's: False
        original(self, *args, **kwargs)

    args = argparse.Namespace(
        level="task", task=task, rounds=10, seeds=seeds, first_seed=0,
        strategies=["fed-lamb"], defences=[defence], attacks=[], hostile=[],
    )  # fmt: skip
    with mock.patch.object(FedAMS, "__init__", init):  # every FedAMS the suite builds
        doc = suite.run_grid(args)
    return [c["metric"] for c in doc["cells"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="mnist5k-cnn")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cfg = validate_run_config(
        {"task": args.task, "strategy": "fed-lamb", "client-optimizer": "fed-ams",
         "client-lr": args.lr}
    )  # fmt: skip
    steps = max(REPORTED)
    app = step_multiples(cfg, correct_v=False, steps=steps)
    corrected = step_multiples(cfg, correct_v=True, steps=steps)
    print(f"{args.task}, client 0 of 10, α = {args.lr:g}: mean |Δθ| / α per step")
    print("| step | Fed-AMS (the app's) | v bias-corrected | ratio |")
    print("|---|---|---|---|")
    for t in REPORTED:
        a, c = app[t - 1], corrected[t - 1]
        print(f"| {t} | {a:.2f} | {c:.2f} | {a / c:.1f}× |")
    result = {"task": args.task, "lr": args.lr, "steps": {
        "app": app, "bias-corrected-v": corrected}}  # fmt: skip
    if args.seeds:
        runs = {
            name: honest_accuracy(args.task, args.lr, args.seeds, correct)
            for name, correct in (("app", False), ("bias-corrected-v", True))
        }
        result["honest-accuracy"] = runs
        print(f"honest accuracy after 10 rounds, seeds 0-{args.seeds - 1}:")
        for name, accuracies in runs.items():
            print(f"  {name}: " + ", ".join(f"{a:.3f}" for a in accuracies))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
