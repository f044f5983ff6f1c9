"""SCAFFOLD's client half (Karimireddy et al., ICML 2020, Algorithm 1, option II).

Client i starts from y = x with its control variate c_i (client state, 0
the first time) and the server's c, and corrects every local gradient:

    y ← y − η_l (g_i(y) − c_i + c)                      (line 10)
    c_i⁺ = c_i − c + (x − y) / (K η_l)                   (line 12, option II)

then sends Δc_i = c_i⁺ − c_i (besides its model, i.e. Δy_i) and keeps c_i⁺.
The correction c − c_i is added to ``p.grad`` in
:meth:`~fedadapt.client.local_update.ClientUpdate.after_backward`: after
gradient clipping and weight decay (the paper has neither; our choice, as
common SCAFFOLD code, which adds the correction to the gradient or to the
step unclipped), in every pass of a re-evaluating optimizer (Δ-SGD). K is
the number of local steps taken, η_l the round's client learning rate (after
``client-lr-decay``); with another optimizer than SGD (momentum, Δ-SGD's
adaptive step) (x − y)/(K η_l) keeps option II's form with that nominal η_l
(our choice). Control variates cover the trainable parameters
(``named_parameters``), not buffers. The server half is
:class:`fedadapt.strategies.scaffold.Scaffold`.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.common.logger import log
from torch import nn

from fedadapt.client.local_update import (
    CLIENT_UPDATES,
    ClientUpdate,
    LocalEnd,
    LocalStart,
)
from fedadapt.strategies import wire


@CLIENT_UPDATES.register("scaffold")
class ScaffoldClient(ClientUpdate):
    """Corrects each local gradient by c − c_i; returns Δc_i, keeps c_i⁺.

    A kept c_i that is unusable (unreadable, not finite, or not matching
    the model's parameters) is reset: this round steps with c_i = c (no
    correction), sends Δc_i = 0 (the lost c_i is not mixed into the
    server's c), keeps the new c_i⁺ and reports
    ``local-update-state-reset`` = 1 (our choice).
    """

    name: ClassVar[str] = "scaffold"

    def check_state(self, state: Mapping[str, Any]) -> str | None:
        """Refuse a state that is not finite float arrays."""
        for key, value in state.items():
            if not isinstance(value, np.ndarray) or not np.issubdtype(
                value.dtype, np.floating
            ):
                return f"c_i '{key}' is not a float array"
            if not np.all(np.isfinite(value)):
                return f"c_i '{key}' is not finite"
        return None

    def begin(self, start: LocalStart) -> None:
        """Take c (server arrays), c_i (client state), x and η_l."""
        params = {n: p for n, p in start.model.named_parameters() if p.requires_grad}
        c = _tensors(params, start.arrays, "the server's c")
        if isinstance(c, str):
            raise ValueError(
                f"scaffold: {c} (the server half, fedadapt.strategies.Scaffold, "
                "sends one array per trainable parameter of this task's model)"
            )
        self.reset = start.state_reset
        c_i = _tensors(params, start.state or {}, "the kept c_i")
        if start.state is not None and isinstance(c_i, str):
            log(WARNING, "fedadapt: local update scaffold: client state reset: %s", c_i)
            self.reset = True
        if self.reset or isinstance(c_i, str):
            c_i = c  # nothing known of this client: no correction this round
        self.c, self.c_i = c, c_i
        self.correction = {n: c[n] - c_i[n] for n in params}
        self.x = {n: p.detach().clone() for n, p in params.items()}
        self.lr = start.lr

    def after_backward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """G ← g − c_i + c (line 10)."""
        for n, p in model.named_parameters():
            if p.grad is not None and n in self.correction:
                p.grad.add_(self.correction[n])

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """c_i⁺ = c_i − c + (x − y)/(K η_l); send Δc_i = c_i⁺ − c_i (0 if reset)."""
        params = dict(model.named_parameters())
        kept, delta = {}, {}
        with torch.no_grad():
            for n, x in self.x.items():
                drift = (x - params[n].detach()) / (steps * self.lr)
                c_plus = self.c_i[n] - self.c[n] + drift
                kept[n] = c_plus.cpu().numpy()
                change = (
                    torch.zeros_like(c_plus) if self.reset else c_plus - self.c_i[n]
                )
                delta[n] = change.cpu().numpy()
        metrics = {wire.LOCAL_STATE_RESET: 1.0} if self.reset else {}
        return LocalEnd(arrays=delta, metrics=metrics, state=kept)


def _tensors(
    params: Mapping[str, torch.Tensor], arrays: Mapping[str, Any], what: str
) -> dict[str, torch.Tensor] | str:
    """One tensor per parameter from ``arrays`` (0 where none), or why not.

    ``arrays`` must be empty (all 0) or hold exactly the parameters' names
    with their shapes.
    """
    if arrays and set(arrays) != set(params):
        return f"{what} has arrays {sorted(arrays)}, the model {sorted(params)}"
    out = {}
    for n, p in params.items():
        value = arrays.get(n)
        if value is None:
            out[n] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            continue
        if tuple(np.shape(value)) != tuple(p.shape):
            return (
                f"{what}['{n}'] has shape {np.shape(value)}, the model {tuple(p.shape)}"
            )
        out[n] = torch.as_tensor(np.asarray(value)).to(p.detach())
    return out
