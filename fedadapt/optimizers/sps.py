"""Stochastic Polyak step size (SPS), a baseline of the Δ-SGD paper.

Loizou, Vaswani, Laradji & Lacoste-Julien, "Stochastic Polyak Step-size for
SGD: An Adaptive Learning Rate for Fast Convergence", AISTATS 2021,
arXiv:2002.10542: eq. (4) with the smoothing of their §5 ("SPS_max" with an
exponentially growing cap). The Δ-SGD paper (Kim et al., arXiv:2306.11201,
Table 1 and the footnote to its §4 setup) runs it with the official defaults
``f* = 0`` and ``c = 0.5``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fedadapt.optimizers._eager import EagerOptimizer

Closure = Callable[[], torch.Tensor]


class SPS(EagerOptimizer):
    r"""SGD with the stochastic Polyak step size.

    Per step ``k`` on the mini-batch loss ``f_B`` (arXiv:2002.10542 eq. (4),
    smoothed as in the authors' ``smooth_iter`` mode)::

        η_k = min{ (f_B(x_k) − f*) / (c ‖∇f_B(x_k)‖² + ε),  γ^{1/n} η_{k−1} }
        x_{k+1} = x_k − η_k ∇f_B(x_k)

    with ``η_{−1} = lr``. The cap ``γ^{1/n} η_{k−1}`` lets the step size grow
    by at most a factor γ every ``n`` steps. A loss below ``f*`` or a gradient
    with ``‖∇f_B‖ < 1e-8`` gives ``η_k = 0`` (no move) and leaves the cap
    as it was — a deviation from the official code, whose cap becomes 0 after
    such a step and freezes every later one. The norm is the global L2 norm
    over every parameter of the group that has a gradient;
    ``param_groups[i]["lr"]`` holds the current ``η_{k−1}``.

    A fresh optimizer per round (as fedadapt's clients build) restarts the cap
    from ``lr`` each round.

    Parameters
    ----------
    params : iterable
        Parameters or parameter-group dicts.
    lr : float, default 1.0
        Initial step size ``η_{−1}`` (the official ``init_step_size``).
    c : float, default 0.5
        Polyak scaling ``c > 0`` (official default).
    f_star : float, default 0.0
        Lower bound ``f*`` of the mini-batch loss (0 for non-negative losses).
    gamma : float, default 2.0
        Growth factor ``γ ≥ 1`` of the cap.
    steps_per_epoch : int, default 500
        ``n`` of the cap (official ``n_batches_per_epoch`` default).
    eps : float, default 1e-8
        ``ε`` added to the denominator.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1.0,
        c: float = 0.5,
        f_star: float = 0.0,
        gamma: float = 2.0,
        steps_per_epoch: int = 500,
        eps: float = 1e-8,
    ) -> None:
        checks = {
            "lr": lr > 0 and math.isfinite(lr),
            "c": c > 0 and math.isfinite(c),
            "f_star": math.isfinite(f_star),
            "gamma": gamma >= 1 and math.isfinite(gamma),
            "steps_per_epoch": steps_per_epoch >= 1,
            "eps": eps >= 0 and math.isfinite(eps),
        }
        values = dict(
            lr=lr,
            c=c,
            f_star=f_star,
            gamma=gamma,
            steps_per_epoch=steps_per_epoch,
            eps=eps,
        )
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SPS: invalid {name}={values[name]!r}")
        super().__init__(params, values)
        self.history: list[list[float]] = [[] for _ in self.param_groups]

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Any:  # type: ignore[override]
        """Take one SPS step; return the closure's loss.

        Parameters
        ----------
        closure : callable
            Zeroes the gradients, computes the mini-batch loss, calls
            ``backward()`` and returns the loss. Required: the Polyak step
            needs the loss value.

        Raises
        ------
        ValueError
            No closure.
        FloatingPointError
            Non-finite loss or gradient; nothing is changed.
        """
        if closure is None:
            raise ValueError("SPS needs step(closure): the step size uses the loss")
        with torch.enable_grad():
            loss = closure()
        loss_value = float(loss)
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"SPS: non-finite loss {loss_value}")
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            sq_norm = 0.0
            if grads:  # one host synchronisation per step
                norms = torch.stack(torch._foreach_norm(grads)).double()
                sq_norm = float(norms.square().sum())
            if not math.isfinite(sq_norm):
                raise FloatingPointError("SPS: non-finite gradient")
            gap = loss_value - group["f_star"]
            if sq_norm < 1e-16 or gap < 0:
                eta = 0.0
            else:
                polyak = gap / (group["c"] * sq_norm + group["eps"])
                growth = group["gamma"] ** (1.0 / group["steps_per_epoch"])
                eta = min(polyak, growth * group["lr"])
                torch._foreach_add_(params, grads, alpha=-eta)
                group["lr"] = eta
            self.history[index].append(eta)
        return loss

    def stats(self, group: int = 0) -> dict[str, float]:
        """Summarise this round's step sizes: steps, eta-last/mean/min/max."""
        etas = self.history[group] or [float(self.param_groups[group]["lr"])]
        return {
            "steps": float(len(self.history[group])),
            "eta-last": etas[-1],
            "eta-mean": math.fsum(etas) / len(etas),
            "eta-min": min(etas),
            "eta-max": max(etas),
        }
