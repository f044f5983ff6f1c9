"""Fed-LAMB's client half: v̂ into the optimizer, v back (arXiv:2110.00532).

Fed-LAMB / Fed-AMS Algorithm 1: a client starts each round from the server's
v̂_{r−1} (line 4; v̂_0 = ε·1 in round 1, when the server sends none) and
sends its raw second moments v at the end (line 13). The client optimizer
(``client-optimizer`` fed-lamb or fed-ams,
:class:`fedadapt.optimizers.FedLAMB` / ``FedAMS``) keeps them; this half
moves them between it and the wire. The server half is
:class:`fedadapt.strategies.fedlamb.SecondMoments`, which every Fed-LAMB
strategy runs. No client state is kept between rounds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from fedadapt.client.local_update import (
    CLIENT_UPDATES,
    ClientUpdate,
    LocalEnd,
    LocalStart,
)
from fedadapt.optimizers import uses_second_moments
from fedadapt.strategies.fedlamb import SecondMoments


@CLIENT_UPDATES.register(SecondMoments.name)
class SecondMomentsClient(ClientUpdate):
    """Loads v̂ into the round's Fed-LAMB/Fed-AMS optimizer; returns its v."""

    name: ClassVar[str] = SecondMoments.name

    def begin(self, start: LocalStart) -> None:
        """Start the optimizer from v̂ (ε·1 when the server sent none)."""
        optimizer: Any = start.optimizer
        if optimizer is None or not uses_second_moments(optimizer):
            raise ValueError(
                "strategy fed-lamb exchanges second moments with the client "
                "optimizers fed-lamb and fed-ams; this client's optimizer is "
                f"{type(optimizer).__name__} (set client-optimizer)"
            )
        self.optimizer = optimizer
        self.names = [name for name, _ in start.model.named_parameters()]
        v_hat = start.arrays
        missing = [n for n in self.names if n not in v_hat]
        if v_hat and missing:
            raise ValueError(
                f"the server's v̂ lacks parameter '{missing[0]}' of the model "
                "(does the server run the same task?)"
            )
        optimizer.load_second_moments(
            [torch.as_tensor(v_hat[n]) for n in self.names] if v_hat else None
        )

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """Send v of every parameter, keyed by its name (Algorithm 1 line 13)."""
        moments = self.optimizer.second_moments()
        return LocalEnd(
            arrays={
                n: v.detach().cpu().numpy()
                for n, v in zip(self.names, moments, strict=True)
            }
        )
