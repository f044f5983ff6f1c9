"""Client optimizer benchmark: time per local training step (issue #5).

Times one full local step, forward and backward included, of

* ``torch.optim.SGD`` (the FedAvg local solver, the baseline),
* ``torch.optim.Adam(foreach=True)`` (the baseline of Fed-LAMB / Fed-AMS),
* :class:`fedadapt.optimizers.DeltaSGD` with ``mode="same_batch"`` (two
  forward/backward passes per step from the second step of a round on, with
  ``module=model`` so BatchNorm statistics are preserved) and with
  ``mode="consecutive"`` (one pass),
* :class:`fedadapt.optimizers.FedLAMB` and :class:`~fedadapt.optimizers.FedAMS`
  (library defaults, ``load_second_moments(None)`` once before stepping),
* the A/B of issue #28 item 5: both Δ-SGD rows again with the step as it was
  before (``DeltaSGD`` from ``benchmarks/_old_deltasgd.py``, read from git history,
  marked "(old step)"); the "new/old" column is the paired ratio of the
  current step to the old one (target <= 1.05x),

on two models, defined here as stand-ins until the tasks issue adds them to
``fedadapt.tasks``:

* ``cnn-mnist``: the Δ-SGD paper's MNIST CNN (conv 1->10 5x5, max-pool 2,
  ReLU; conv 10->20 5x5, Dropout2d, max-pool 2, ReLU; FC 320->50, ReLU,
  dropout; FC 50->10), input 1x28x28, 21,840 parameters;
* ``resnet18``: ResNet-18, CIFAR variant (3x3 stem conv with 64 channels, no
  max-pool, stages [2, 2, 2, 2] of BasicBlocks with BatchNorm, average pool 4,
  linear 512->10), input 3x32x32, 11,173,962 parameters;
* ``resnet18-w1``: the same at width 1 (2,991 parameters in the same 62
  tensors), a launch-bound proxy where the optimizer's overhead dominates.

Every optimizer uses the same closure-style step: the closure zeroes the
gradients, runs the forward pass and the cross-entropy loss, calls
``backward()`` and returns the loss; the timed call is ``opt.step(closure)``.
A ``fwd+bwd only`` row times the closure alone (no optimizer) as the floor.

Method: every optimizer gets its own copy of the same seeded model (train
mode) and steps through the same pool of synthetic random batches (fixed
seeds, batch 32). Optimizers are interleaved round-robin, one step each per
round (the order rotates every round), so that machine noise hits all of them
alike; each first takes ``--warmup`` untimed steps (this also takes Δ-SGD past
its single-pass first step), then ``--steps`` timed steps. A step is timed
with ``time.perf_counter`` (after ``torch.cuda.synchronize()`` on both sides
on CUDA), or with ``--clock cpu`` by the process's CPU time (for CPU runs with
``--threads 1`` on a loaded machine, where wall time mostly measures
waiting). The table reports the median ms/step with its interquartile range,
and the ratio to SGD (and, for Fed-LAMB / Fed-AMS, to Adam) as the median over
rounds of the paired per-round ratio, which is robust to load that changes
during the run; the ratios of the medians are in the JSON too. Threads:
torch's default (``torch.get_num_threads()``, printed; ``--threads`` sets
it). The 1-minute load average is printed before and after: on a shared
machine, compare ratios, not milliseconds.

Usage (from the repository root)::

    .venv/bin/python benchmarks/optimizers.py                 # 1.5-3 min, 2 cores
    .venv/bin/python benchmarks/optimizers.py --quick         # smoke test
    .venv/bin/python benchmarks/optimizers.py --steps 20 --json out.json
    python benchmarks/optimizers.py --device cuda

Defaults: ``cnn-mnist`` 20 warm-up + 200 timed steps, ``resnet18`` 5 warm-up +
10 timed steps (``--steps`` / ``--warmup`` set both models). Targets (issue
#5): Δ-SGD same-batch <= 2.1x SGD, consecutive <= 1.1x SGD, Fed-LAMB / Fed-AMS
<= 1.2x Adam; (issue #28) each Δ-SGD step <= 1.05x its old step. The script
prints whether each is met, and exits 0 either way. ``--optimizers`` runs a
subset, e.g. the A/B alone::

    python benchmarks/optimizers.py --models cnn-mnist --steps 600 \
        --optimizers SGD "DeltaSGD same_batch" "DeltaSGD same_batch (old step)" \
        "DeltaSGD consecutive" "DeltaSGD consecutive (old step)"
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._old_deltasgd import OldDeltaSGD  # noqa: E402
from fedadapt.optimizers import DeltaSGD, FedAMS, FedLAMB  # noqa: E402

BATCH = 32
POOL = 4  # distinct synthetic batches, cycled
FLOOR = "fwd+bwd only"

# --- models (stand-ins until the tasks issue lands) ----------------------------


class CNNMnist(nn.Module):
    """The Δ-SGD paper's MNIST CNN (auto-tuned-FL ``CNNMnist``)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return self.fc2(x)


class BasicBlock(nn.Module):
    """ResNet BasicBlock (two 3x3 convs with BatchNorm, identity shortcut)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Cifar(nn.Module):
    """ResNet-18, CIFAR variant: 3x3 stem, no max-pool, average pool 4."""

    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers: list[nn.Module] = []
        c_in = width
        for stage in range(4):
            c_out = width * 2**stage
            stride = 1 if stage == 0 else 2
            layers.append(
                nn.Sequential(
                    BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)
                )
            )
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.avg_pool2d(out, 4).flatten(1)
        return self.linear(out)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    warmup: int
    steps: int
    quick_warmup: int
    quick_steps: int


MODELS = {
    "cnn-mnist": ModelSpec("cnn-mnist", CNNMnist, (1, 28, 28), 20, 200, 5, 30),
    "resnet18": ModelSpec("resnet18", ResNet18Cifar, (3, 32, 32), 5, 10, 2, 3),
    # Launch-bound proxy: ResNet-18's 62 tensors at width 1 (2,991 parameters),
    # so the optimizer's own overhead dominates the step.
    "resnet18-w1": ModelSpec(
        "resnet18-w1", lambda: ResNet18Cifar(width=1), (3, 32, 32), 20, 200, 5, 30
    ),
}

# --- optimizers ----------------------------------------------------------------

# name -> factory(model). Learning rates are moderate so that 200+ steps on
# random labels stay finite; they do not change the cost of a step.
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
    "Adam (foreach)": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, foreach=True),
    "DeltaSGD same_batch": lambda m: DeltaSGD(
        m.parameters(), lr=0.01, mode="same_batch", module=m
    ),
    "DeltaSGD consecutive": lambda m: DeltaSGD(
        m.parameters(), lr=0.01, mode="consecutive"
    ),
    "FedLAMB": lambda m: FedLAMB(m.parameters(), lr=1e-3),
    "FedAMS": lambda m: FedAMS(m.parameters(), lr=1e-3),
    # The A/B baseline: the frozen copy of DeltaSGD before #28 item 5.
    "DeltaSGD same_batch (old step)": lambda m: OldDeltaSGD(
        m.parameters(), lr=0.01, mode="same_batch", module=m
    ),
    "DeltaSGD consecutive (old step)": lambda m: OldDeltaSGD(
        m.parameters(), lr=0.01, mode="consecutive"
    ),
}
SGD, ADAM = "SGD", "Adam (foreach)"
#: Row -> its old-step row (the A/B of issue #28 item 5).
OLD_STEP = {
    "DeltaSGD same_batch": "DeltaSGD same_batch (old step)",
    "DeltaSGD consecutive": "DeltaSGD consecutive (old step)",
}
# (row, baseline, max ratio)
TARGETS = (
    ("DeltaSGD same_batch", SGD, 2.1),
    ("DeltaSGD consecutive", SGD, 1.1),
    ("FedLAMB", ADAM, 1.2),
    ("FedAMS", ADAM, 1.2),
    *((new, old, 1.05) for new, old in OLD_STEP.items()),
)


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
}


@dataclass
class Runner:
    """One optimizer (or the floor, ``opt=None``) on its own model copy."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer | None
    initial: dict[str, torch.Tensor]
    factory: Callable[[nn.Module], torch.optim.Optimizer] | None
    times: dict[int, float] = field(default_factory=dict)  # timed round -> s
    restarts: int = 0

    def restart(self) -> None:
        """Back to the initial weights with a fresh optimizer (after a NaN)."""
        self.model.load_state_dict(self.initial)
        if self.factory is not None:
            self.opt = _make_optimizer(self.factory, self.model)
        self.restarts += 1


def _make_optimizer(
    factory: Callable[[nn.Module], torch.optim.Optimizer], model: nn.Module
) -> torch.optim.Optimizer:
    opt = factory(model)
    if isinstance(opt, FedLAMB | FedAMS):
        opt.load_second_moments(None)  # round 1: v̂_0 = ε·1
    return opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_step(
    runner: Runner,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Run one closure-style step; return its time in seconds on ``clock``."""
    model, opt = runner.model, runner.opt

    def closure() -> torch.Tensor:
        if opt is None:
            model.zero_grad(set_to_none=True)
        else:
            opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    _sync(device)
    t0 = clock()
    if opt is None:
        loss = closure()
    else:
        loss = opt.step(closure)
    _sync(device)
    elapsed = clock() - t0
    if not torch.isfinite(loss):
        raise FloatingPointError(f"{runner.name}: non-finite loss")
    return elapsed


def bench_model(
    spec: ModelSpec,
    names: list[str],
    device: torch.device,
    warmup: int,
    steps: int,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Benchmark every optimizer in ``names`` (plus the floor) on one model."""
    torch.manual_seed(seed)
    base = spec.build().to(device).train()
    initial = {k: v.detach().clone() for k, v in base.state_dict().items()}
    n_params = sum(p.numel() for p in base.parameters())

    gen = torch.Generator().manual_seed(seed + 1)
    pool = [
        (
            torch.randn((BATCH, *spec.input_shape), generator=gen).to(device),
            torch.randint(0, 10, (BATCH,), generator=gen).to(device),
        )
        for _ in range(POOL)
    ]

    runners = [Runner(FLOOR, copy.deepcopy(base), None, initial, None)]
    for name in names:
        model = copy.deepcopy(base)
        factory = OPTIMIZERS[name]
        runners.append(
            Runner(name, model, _make_optimizer(factory, model), initial, factory)
        )
    del base

    torch.manual_seed(seed + 2)  # dropout masks
    for i in range(warmup + steps):
        x, y = pool[i % POOL]
        shift = i % len(runners)  # rotate the order: no fixed position
        for runner in runners[shift:] + runners[:shift]:
            try:
                elapsed = _one_step(runner, x, y, device, clock)
            except FloatingPointError:
                runner.restart()  # the sample is dropped
                continue
            if i >= warmup:
                runner.times[i - warmup] = elapsed

    by_name = {r.name: r for r in runners}
    med = {
        r.name: statistics.median(r.times.values()) * 1e3 for r in runners if r.times
    }

    def paired(name: str, baseline: str) -> float | None:
        """Median over rounds of this round's time / the baseline's."""
        if name not in by_name or baseline not in by_name:
            return None
        a, b = by_name[name].times, by_name[baseline].times
        ratios = [a[k] / b[k] for k in a.keys() & b.keys()]
        return statistics.median(ratios) if ratios else None

    rows = []
    for r in runners:
        ms = med.get(r.name, float("nan"))
        times = sorted(r.times.values())
        q = statistics.quantiles(times, n=4) if len(times) >= 2 else [ms / 1e3] * 3
        rows.append(
            {
                "optimizer": r.name,
                "ms_median": ms,
                "ms_q1": q[0] * 1e3,
                "ms_q3": q[2] * 1e3,
                "timed_steps": len(times),
                "restarts": r.restarts,
                "ratio_sgd": paired(r.name, SGD),
                "ratio_adam": paired(r.name, ADAM),
                "ratio_old_step": paired(r.name, OLD_STEP.get(r.name, "")),
                "ratio_sgd_of_medians": ms / med[SGD] if SGD in med else None,
                "ratio_adam_of_medians": ms / med[ADAM] if ADAM in med else None,
            }
        )
    targets = []
    for name, baseline, limit in TARGETS:
        ratio = paired(name, baseline)
        if ratio is not None:
            targets.append(
                {
                    "optimizer": name,
                    "baseline": baseline,
                    "ratio": ratio,
                    "target": limit,
                    "met": ratio <= limit,
                }
            )
    return {
        "model": spec.name,
        "parameters": n_params,
        "batch": BATCH,
        "warmup": warmup,
        "steps": steps,
        "rows": rows,
        "targets": targets,
    }


# --- report --------------------------------------------------------------------


def _fmt_ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def format_table(result: dict[str, Any]) -> str:
    """Markdown table of one model's results."""
    lines = [
        f"{result['model']} ({result['parameters']:,} parameters, batch "
        f"{result['batch']}, {result.get('clock', 'wall')} clock, "
        f"{result['warmup']} warm-up + {result['steps']} timed "
        "steps)",
        "",
        "| optimizer | ms/step (median) | IQR (ms) | vs SGD | vs Adam | new/old |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        vs_adam = row["optimizer"] in ("FedLAMB", "FedAMS")
        extra = f" ({row['restarts']} restarts)" if row["restarts"] else ""
        lines.append(
            f"| {row['optimizer']}{extra} | {row['ms_median']:.2f} | "
            f"{row['ms_q1']:.2f}-{row['ms_q3']:.2f} | "
            f"{_fmt_ratio(row['ratio_sgd'])} | "
            f"{_fmt_ratio(row['ratio_adam']) if vs_adam else ''} | "
            f"{_fmt_ratio(row['ratio_old_step'])} |"
        )
    lines.append("")
    for t in result["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(
            f"- {t['optimizer']}: {t['ratio']:.2f}x {t['baseline']} "
            f"(target <= {t['target']}x): {verdict}"
        )
    return "\n".join(lines)


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables (and write JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="few steps per model (smoke test)"
    )
    parser.add_argument(
        "--steps", type=int, help="timed steps per optimizer (all models)"
    )
    parser.add_argument(
        "--warmup", type=int, help="untimed steps per optimizer (all models)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda if available",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=tuple(MODELS),
        default=list(MODELS),
        help="models to run (default: all)",
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=tuple(OPTIMIZERS),
        default=list(OPTIMIZERS),
        metavar="NAME",
        help="optimizers to run (default: all): " + ", ".join(OPTIMIZERS),
    )
    parser.add_argument(
        "--threads", type=int, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall: time.perf_counter (default); cpu: time.process_time, "
        "this process's CPU time, for a CPU run with --threads 1 on a loaded "
        "machine (waiting for a core does not count)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write results to this file")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.warmup is not None and args.warmup < 1:
        parser.error("--warmup must be >= 1 (Δ-SGD's first step is single-pass)")
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times CPU work only: use it with --device cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info(device)
    info["loadavg_start"] = os.getloadavg()[0]
    print(
        f"torch {info['torch']} on {device}"
        + (f" ({info['gpu']})" if "gpu" in info else "")
        + f"; CPU {info.get('cpu', '?')}, {info['cpu_count']} cores, "
        f"torch threads {info['torch_threads']}; load average "
        f"{info['loadavg_start']:.2f}",
        flush=True,
    )

    results = []
    start = time.perf_counter()
    for name in args.models:
        spec = MODELS[name]
        warmup = args.warmup or (spec.quick_warmup if args.quick else spec.warmup)
        steps = args.steps or (spec.quick_steps if args.quick else spec.steps)
        t0 = time.perf_counter()
        result = bench_model(
            spec, args.optimizers, device, warmup, steps, args.seed, CLOCKS[args.clock]
        )
        result["clock"] = args.clock
        result["wall_s"] = time.perf_counter() - t0
        results.append(result)
        print()
        print(format_table(result))
        print(f"({result['wall_s']:.1f} s)", flush=True)
    total = time.perf_counter() - start
    info["loadavg_end"] = os.getloadavg()[0]
    print(f"\ntotal {total:.1f} s; load average {info['loadavg_end']:.2f}")

    if args.json:
        payload = {"machine": info, "total_s": total, "results": results}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
