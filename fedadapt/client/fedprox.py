"""FedProx's client half (Li et al., MLSys 2020, Algorithm 2 line 5).

Client k minimises h_k(w; w_t) = F_k(w) + (μ/2)‖w − w_t‖² from the global
model w_t: the term is added to every local loss, so every gradient gains
μ(w − w_t), with any client optimizer (Δ-SGD's two same-batch passes
included). The server half is :class:`fedadapt.strategies.fedprox.FedProx`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from fedadapt.client.local_update import (
    CLIENT_UPDATES,
    ClientUpdate,
    LocalEnd,
    LocalStart,
)
from fedadapt.strategies.fedprox import MU, FedProx


@CLIENT_UPDATES.register("fedprox")
class FedProxClient(ClientUpdate):
    """Adds (μ/2)‖w − w_t‖² over the model's parameters to the local loss.

    Metric ``fedprox-term``: the term at the end of local training.
    """

    name: ClassVar[str] = "fedprox"

    def begin(self, start: LocalStart) -> None:
        """Keep μ (``fedprox.mu``) and a copy of w_t."""
        mu = start.config.get(FedProx.key(MU))
        if isinstance(mu, bool) or not isinstance(mu, int | float) or not mu >= 0:
            raise ValueError(
                f"the train config's fedprox.mu must be a number >= 0, got {mu!r} "
                "(the server half, fedadapt.strategies.FedProx, sends it)"
            )
        self.mu = float(mu)
        self.anchor = [p.detach().clone() for p in start.model.parameters()]

    def loss_term(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        outputs: torch.Tensor,
    ) -> torch.Tensor:
        """(μ/2) Σ_p ‖p − p_t‖²."""
        return self.term(model)

    def term(self, model: nn.Module) -> torch.Tensor:
        """(μ/2) Σ_p ‖p − p_t‖² of ``model``'s parameters."""
        squares = [
            torch.sum((p - a) ** 2)
            for p, a in zip(model.parameters(), self.anchor, strict=True)
        ]
        return 0.5 * self.mu * torch.stack(squares).sum()

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """Report ``fedprox-term``: (μ/2)‖w − w_t‖² of the trained model."""
        with torch.no_grad():
            term = self.term(model)
        return LocalEnd(metrics={"fedprox-term": float(term)})
