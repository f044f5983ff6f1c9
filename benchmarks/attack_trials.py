"""Defences tried against the attack suite and not kept (issue #38, stops 58 and 60).

Each trial changes one thing in fedadapt's aggregation path for the length
of a run (a patch of this process only) and runs the attack suite's own
task loop (:func:`benchmarks.attacks.federate`) on digits-mlp, 5 seeds,
against the unchanged default and FedAvg under the same attack:

- ``history-guard``: FedExPM's step guard over the momentum's history. The
  guard of the default caps η_t at min_i η_t^{(−i)}, each computed from this
  round without client i but from the momentum v_{t−1} that holds all of
  client i's earlier pushes. The trial keeps, per client, the momentum and
  m the run would have had without it, v_{−i,t} = β1·v_{−i,t−1} +
  (1−β1)·Δ̄_{−i,t} (m likewise), and caps η_t at the smallest of those
  steps. Hypothesis tested: FedExPM's excess distance is its momentum
  carrying the hostile client's past pushes past the one-round guard.
- ``move-cap``: a cap on the server's move, ‖x_{t+1} − x_t‖ ≤ κ·√A_t (A:
  the clients' mean ‖Δ_i‖², as the rule saw it), ``--kappa`` values; also
  reports the largest ratio ρ = ‖x_{t+1} − x_t‖/√A_t seen in honest and
  attacked runs. Hypothesis tested: three colluders make the adaptive rules
  diverge through single large steps.
- ``histogram-a`` (stop 60, under SecAgg+: ``--defence secagg+`` or
  ``secagg+-guarded``): the step guard's A from the clients' norm
  histogram. In plain mode the guard's A leaves out the shortest update, so
  that no client lowers FedExP's and FedDuA's step with a short reply;
  under SecAgg+ the histogram tells how short the shortest *claim* is, and
  A' = max(A, (A − ω_min·τ*²)/(1 − ω_min)), τ* the first level with a
  client at or below it (:func:`histogram_guarded_sq_norm`), is never above
  plain mode's A' for the same claims and leaves a zero claim out exactly.
  Hypothesis tested: the zero norm claims of ``stall`` cost FedExPM and
  FedDuAdam 3–4 points (one client) through the lower A.

Usage (from the repository root)::

    python benchmarks/attack_trials.py history-guard --attacks sign-flip,ipm
    python benchmarks/attack_trials.py move-cap --hostile 3 --kappa inf,10,4
    python benchmarks/attack_trials.py histogram-a --defence secagg+ \
        --seeds 3 --strategies fedexp,fedexpm,feddua,feddua-adagrad \
        --attacks stall,ipm,false-norm,sign-flip

The first two were measured at stop 58 against the default of the time,
before the norm ceiling: ``--defence no-ceiling`` reproduces them (the
default is today's default).

Results: a JSON file (``--out``) and a table on stdout (points lost against
the same strategy's honest run, distance from it ÷ FedAvg's).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.attacks as suite  # noqa: E402
import fedadapt.strategies.adapter as adapter  # noqa: E402
from benchmarks._output import write_json  # noqa: E402
from fedadapt.strategies.core.aggregation import (  # noqa: E402
    GUARD_A_MIN_CLIENTS,
    apply_statistics,
)
from fedadapt.strategies.feddua import FedDuARule  # noqa: E402
from fedadapt.strategies.secagg import norm_levels  # noqa: E402

TASK = "digits-mlp"
ROUNDS = 20  # the attack suite's digits-mlp runs


@contextmanager
def history_guard() -> Iterator[None]:
    """FedExPM's (and FedDuAdam's, identity only) guard over the history."""
    plain = FedDuARule.guard_step_size

    def guard(self: FedDuARule, stats: Any) -> float | None:
        if self.variant != "adam" or self.preconditioner != "identity":
            return plain(self, stats)
        self.leave_one_out_steps = None
        if stats.without_each is None:
            return None
        b1, eps_g = self.beta_1, self.step_epsilon(stats)
        history = self.__dict__.setdefault("_without", {})
        steps = []
        for i, (delta, a) in enumerate(stats.without_each()):  # i: the node
            v_before, m_before = history.get(i, (self.v, self.m))
            m = 0.5 * b1 * m_before + (1 - b1) * 0.5 * a
            v = {
                k: (1 - b1) * d if v_before is None else b1 * v_before[k] + (1 - b1) * d
                for k, d in delta.items()
            }
            history[i] = (v, m)
            q = math.fsum(float(np.vdot(x, x)) for x in v.values()) + eps_g
            steps.append(m / q if q > 0 else 0.0)
        self.leave_one_out_steps = steps
        return min(steps) if steps else None

    FedDuARule.guard_step_size = guard  # type: ignore[method-assign]
    try:
        yield
    finally:
        FedDuARule.guard_step_size = plain  # type: ignore[method-assign]


@contextmanager
def move_cap(kappa: float, ratios: list[float]) -> Iterator[None]:
    """Cap ‖x_{t+1} − x_t‖ at κ·√A_t; append each round's ρ to ``ratios``."""

    def capped(rule: Any, current: Any, stats: Any) -> Any:
        new, diagnostics = apply_statistics(rule, current, stats)
        a = stats.mean_sq_norm
        if a:
            keys = rule.adaptive_keys(current)
            rho = math.sqrt(diagnostics["server-move-sq-norm"] / a)
            ratios.append(rho)
            if rho > kappa:
                for k in keys:
                    step = (new[k] - current[k]) * (kappa / rho)
                    new[k] = (current[k] + step).astype(current[k].dtype)
        return new, diagnostics

    adapter.apply_statistics = capped  # type: ignore[assignment]
    try:
        yield
    finally:
        adapter.apply_statistics = apply_statistics


def histogram_guarded_sq_norm(
    mean_sq_norm: float, shares: Sequence[float], weights: Sequence[float]
) -> float:
    """Return A without the shortest norm the SecAgg+ histogram claims.

    ``shares``: the weighted share of clients whose ‖Δ_j‖ exceeds each
    τ_j (:func:`fedadapt.strategies.secagg.norm_levels`); ``weights``: the
    clients' r_i. The first τ* with at least ω_min/2 of the weight at or
    below it bounds the shortest claim from above; for s ≤ τ*² < A,
    (A − ω s)/(1 − ω) rises with ω and falls with s, so the result is at
    most plain mode's guarded A (max_j A_{−j},
    :func:`fedadapt.strategies.core.aggregation.guarded_sq_norms`) for the
    same claims. A as it is with fewer than ``GUARD_A_MIN_CLIENTS`` clients.
    """
    total = float(sum(weights))
    if len(weights) < GUARD_A_MIN_CLIENTS or total <= 0 or len(shares) == 0:
        return mean_sq_norm
    smallest = min(weights) / total
    for level, share in zip(norm_levels(), shares, strict=False):
        if 1.0 - float(share) >= smallest / 2:  # someone at or below τ_j
            without = (mean_sq_norm - smallest * float(level) ** 2) / (1 - smallest)
            return max(mean_sq_norm, without)
    return mean_sq_norm


@contextmanager
def histogram_a() -> Iterator[None]:
    """Step SecAgg+ rounds on :func:`histogram_guarded_sq_norm`'s A."""
    plain = suite.step_statistics

    def guarded(decoded: Any, **kwargs: Any) -> Any:
        stats = plain(decoded, **kwargs)
        a = stats.mean_sq_norm
        if a is None or decoded.norm_shares is None:
            return stats
        a_guard = histogram_guarded_sq_norm(a, decoded.norm_shares, kwargs["weights"])
        return dataclasses.replace(stats, mean_sq_norm=a_guard)

    suite.step_statistics = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        suite.step_statistics = plain


def run(
    strategy: str,
    seed: int,
    attack: str | None,
    hostile: int,
    variant: Callable[[], Any],
    defence: str = "default",
) -> tuple[float, dict, dict]:
    """One run of the suite's loop under ``variant``; accuracy, model, x_0."""
    overrides = {"seed": seed, "num-server-rounds": ROUNDS}
    cfg = suite.strategy_config(
        strategy, TASK, {**overrides, **suite.DEFENCE_CONFIG.get(defence, {})}
    )
    options = {**suite.apply_options(cfg), **suite.DEFENCES[defence]}
    x0, train, metric = suite.task_setup(cfg)
    with variant():
        model, _ = suite.federate(
            cfg, options, x0, train, ROUNDS, attack, list(range(hostile)), seed
        )
    return metric(model), model, x0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trial", choices=("history-guard", "move-cap", "histogram-a"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--hostile", type=int, default=1)
    parser.add_argument("--attacks", default="sign-flip,scaled-copy,ipm")
    parser.add_argument("--strategies", default="fedexpm")
    parser.add_argument("--kappa", default="inf,10,4")
    parser.add_argument("--defence", default="default", choices=suite.DEFENCES)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    attacks = args.attacks.split(",")
    ratios: list[float] = []
    plain: Callable[[], Any] = nullcontext
    if args.trial == "history-guard":
        variants = {"default": plain, "history-guard": history_guard}
    elif args.trial == "histogram-a":
        variants = {"default": plain, "histogram-a": histogram_a}
    else:
        variants = {
            f"kappa={k}": (lambda k=float(k): move_cap(k, ratios))
            for k in args.kappa.split(",")
        }
    cells = []
    for seed in range(args.seeds):
        for strategy in ["fedavg", *args.strategies.split(",")]:
            chosen = {"default": plain} if strategy == "fedavg" else variants
            for name, variant in chosen.items():
                ratios.clear()
                honest_metric, honest, x0 = run(
                    strategy, seed, None, 0, variant, args.defence
                )
                honest_ratio = max(ratios, default=0.0)
                scale = suite.float_distance(honest, x0) or 1.0
                for attack in attacks:
                    ratios.clear()
                    value, model, _ = run(
                        strategy, seed, attack, args.hostile, variant, args.defence
                    )
                    cells.append({
                        "seed": seed, "strategy": strategy, "variant": name,
                        "attack": attack, "honest_metric": honest_metric,
                        "metric": value,
                        "distance": suite.float_distance(model, honest) / scale,
                        "move_ratio_max": max(ratios, default=0.0),
                        "honest_move_ratio_max": honest_ratio,
                    })  # fmt: skip
                print(f"seed {seed} {strategy} {name}: honest {honest_metric:.4f}")
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for cell in cells:
        groups[(cell["strategy"], cell["variant"], cell["attack"])].append(cell)
    fedavg = {
        a: np.mean([c["distance"] for c in groups[("fedavg", "default", a)]])
        for a in attacks
    }
    print(
        "| strategy | variant | attack | honest | points lost | distance ÷ FedAvg's |"
    )
    print("|---|---|---|---|---|---|")
    for (strategy, name, attack), group in sorted(groups.items()):
        honest = 100 * np.mean([c["honest_metric"] for c in group])
        lost = 100 * np.mean([c["honest_metric"] - c["metric"] for c in group])
        ratio = np.mean([c["distance"] for c in group]) / fedavg[attack]
        print(f"| {strategy} | {name} | {attack} | {honest:.1f} | {lost:+.1f} "
              f"| {ratio:.3g}× |")  # fmt: skip
    if args.out:
        write_json(args.out, {"trial": args.trial, "args": vars(args) | {
            "out": str(args.out)}, "cells": cells})  # fmt: skip


if __name__ == "__main__":
    main()
