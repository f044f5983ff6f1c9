"""Optimizer-only A/B of ``DeltaSGD.step``: the current step vs the old one.

The share of a local step where a slower ``step()`` would show: the gradients
are preset (the closure only copies them into ``.grad``), so no forward or
backward pass is timed. Old (``benchmarks/_old_deltasgd.py``, from git history) and new
optimizers run on their own copy of the same model, interleaved step by step
(the order alternates), ``reset()`` every 50 steps (a round), and each step is
timed by the process's CPU time with one torch thread, so that load from other
processes on a shared machine does not count. Prints the median µs per step
and the ratio new/old (of the medians and of the means).

Usage (from the repository root)::

    python benchmarks/deltasgd_step_ab.py              # about 1 min, 1 core
    python benchmarks/deltasgd_step_ab.py --steps 500  # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._old_deltasgd import OldDeltaSGD  # noqa: E402
from benchmarks.optimizers import CNNMnist, ResNet18Cifar  # noqa: E402
from fedadapt.optimizers import DeltaSGD  # noqa: E402

MODELS = {
    "resnet18-w1 (62 tensors)": lambda: ResNet18Cifar(width=1),
    "cnn-mnist (8 tensors)": CNNMnist,
}
ROUND = 50  # steps between resets


def ab(build, mode: str, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Return the per-step CPU seconds of (old, new) on one model and mode."""
    runs = []
    for cls in (OldDeltaSGD, DeltaSGD):
        torch.manual_seed(0)
        params = list(build().parameters())
        gen = torch.Generator().manual_seed(1)
        pool = [[torch.randn(p.shape, generator=gen) * 1e-3 for p in params]]
        pool.append([torch.randn(p.shape, generator=gen) * 1e-3 for p in params])
        opt = cls(params, lr=0.01, mode=mode)

        def closure(params=params, pool=pool, opt=opt) -> float:
            for p, g in zip(params, pool[len(opt.history[0]) % 2], strict=True):
                p.grad = g.clone()
            return 0.0

        runs.append((opt, closure, []))
    for i in range(warmup + steps):
        for opt, closure, times in runs if i % 2 else runs[::-1]:
            if i % ROUND == 0:
                opt.reset()
            t0 = time.process_time()
            opt.step(closure)
            if i >= warmup:
                times.append(time.process_time() - t0)
    return runs[0][2], runs[1][2]


def main(argv: list[str] | None = None) -> int:
    """Run the A/B on both models and modes; print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2800)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread, CPU-time clock")
    for name, build in MODELS.items():
        for mode in ("consecutive", "same_batch"):
            old, new = ab(build, mode, args.steps, args.warmup)
            med_old, med_new = statistics.median(old), statistics.median(new)
            print(
                f"{name} {mode}: old {med_old * 1e6:.0f} µs, new {med_new * 1e6:.0f} "
                f"µs; new/old {med_new / med_old:.3f} (medians), "
                f"{statistics.fmean(new) / statistics.fmean(old):.3f} (means)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
