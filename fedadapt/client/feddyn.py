"""FedDyn's client half (Acar et al., ICLR 2021, Algorithm 1 lines 5-6).

Client k trains from θ^{t−1} (the model it receives) on

    L_k(θ) − ⟨g_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖²                      (line 5)

with g_k = ∇L_k(θ_k^{t−1}) its gradient state (client state; 0 before its
first round), then keeps

    g_k ← g_k − α(θ_k^t − θ^{t−1})                               (line 6).

The two extra terms enter as their gradient, −g_k + α(θ − θ^{t−1}), added
to ``p.grad`` in :meth:`~fedadapt.client.local_update.ClientUpdate.after_backward`
(exact, and the same in every pass of a re-evaluating optimizer). Our
choices where the paper is silent: the terms are added after gradient
clipping and weight decay (as SCAFFOLD's correction here), so clipping acts
on the task gradient only; the state covers the trainable parameters
(``named_parameters``), not buffers; a state that cannot be used (not
finite, or not matching the model) is reset to g_k = 0, logged and
reported as ``local-update-state-reset`` = 1. α arrives as ``feddyn.alpha``
from the server half :class:`fedadapt.strategies.feddyn.FedDynLocal`; the
client sends back its model only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from fedadapt.client.local_update import (
    CLIENT_UPDATES,
    ClientUpdate,
    LocalEnd,
    LocalStart,
    log_state_reset,
)
from fedadapt.strategies import wire
from fedadapt.strategies.feddyn import ALPHA, FedDynLocal


@CLIENT_UPDATES.register(FedDynLocal.name)
class FedDynClient(ClientUpdate):
    """Adds −g_k + α(θ − θ^{t−1}) to each gradient; keeps g_k (line 6)."""

    name: ClassVar[str] = FedDynLocal.name

    def check_state(self, state: Mapping[str, Any]) -> str | None:
        """Refuse a state that is not finite float arrays."""
        for key, value in state.items():
            if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
                return f"g_k '{key}' is not a float array"
            if not np.all(np.isfinite(value)):
                return f"g_k '{key}' is not finite"
        return None

    def begin(self, start: LocalStart) -> None:
        """Take α, θ^{t−1} (the model as received) and g_k (0 the first time)."""
        self.alpha = float(ALPHA.check(start.config[FedDynLocal.key(ALPHA)]))
        params = {n: p for n, p in start.model.named_parameters() if p.requires_grad}
        self.theta = {n: p.detach().clone() for n, p in params.items()}
        kept = start.state or {}
        self.reset = start.state_reset
        if kept and (
            set(kept) != set(params)
            or any(np.shape(kept[n]) != tuple(p.shape) for n, p in params.items())
        ):
            log_state_reset(self, "g_k does not match the model's parameters")
            kept, self.reset = {}, True
        self.g = {
            n: torch.as_tensor(kept[n]).to(p.detach())
            if n in kept
            else torch.zeros_like(p, memory_format=torch.contiguous_format)
            for n, p in params.items()
        }

    def after_backward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """∇ of line 5's extra terms: grad ← grad − g_k + α(θ − θ^{t−1})."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.grad is not None and n in self.g:
                    p.grad.sub_(self.g[n]).add_(p - self.theta[n], alpha=self.alpha)

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """Keep g_k − α(θ_k^t − θ^{t−1}) (line 6); send nothing but the model."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            kept = {
                n: (g - self.alpha * (params[n].detach() - self.theta[n])).cpu().numpy()
                for n, g in self.g.items()
            }
        metrics = {wire.LOCAL_STATE_RESET: 1.0} if self.reset else {}
        return LocalEnd(metrics=metrics, state=kept)
