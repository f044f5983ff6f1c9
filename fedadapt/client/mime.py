"""Mime and MimeLite's client half (Karimireddy et al. 2020a, Algorithm 1, SGDm).

Each local step of plain SGD (run-config ``client-optimizer=sgd``, which the
config requires) is given the direction of the base optimizer SGDm with the
server's momentum m held fixed: :meth:`MimeLiteClient.after_backward`
replaces every gradient by (1 − β)·g + β·m, so SGD steps
y ← y − η_l((1 − β)·g + β·m), with

- MimeLite: g = ∇f_i(y; ζ), the gradient the closure computed (after
  clipping and weight decay, as for every client);
- Mime: g = ∇f_i(y; ζ) − ∇f_i(x; ζ) + c, where ∇f_i(x; ζ) is the task loss's
  gradient on the same batch at the global model x (a frozen copy kept for
  the round) and c the server's mean full-batch gradient (none in round 1:
  MimeLite's step, see :mod:`fedadapt.strategies.mime`).

At the start of the round the client computes its full-batch gradient
∇f_i(x) of the task loss over its train split at x and sends it back (one
array per trainable parameter) for the server's momentum. Gradients at x
are taken in training mode (dropout active, as in the local steps; the
train split as training loads it, augmentation included) on a copy, so the
trained model's buffers are untouched. Mime keeps no client
state across rounds. The server half is
:class:`fedadapt.strategies.mime.Mime` / :class:`~fedadapt.strategies.mime.MimeLite`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from fedadapt.client.local_update import (
    CLIENT_UPDATES,
    ClientUpdate,
    LocalEnd,
    LocalStart,
)
from fedadapt.strategies.mime import BETA, CORRECTION, MOMENTUM, Mime, MimeLite
from fedadapt.tasks.base import batch_loader


def full_batch_gradient(
    model: nn.Module,
    criterion: nn.Module,
    data: Dataset,
    batch_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Return ∇f_i of the task loss over all of ``data`` at ``model``'s weights.

    The mean loss over the examples: Σ_b n_b·∇(mean loss of batch b) / n,
    summed batch by batch in order (``criterion`` averages over a batch).
    ``model``'s own ``.grad`` is left as it was.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    count = 0
    for inputs, targets in batch_loader(data, batch_size, shuffle=False):
        inputs, targets = inputs.to(device), targets.to(device)
        loss = criterion(model(inputs), targets)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (name, _), grad in zip(params.items(), grads, strict=True):
            if grad is not None:
                total[name].add_(grad, alpha=len(targets))
        count += len(targets)
    if count == 0:
        raise ValueError("Mime: the full-batch gradient needs local data (empty split)")
    return {n: g.div_(count) for n, g in total.items()}


@CLIENT_UPDATES.register("mimelite")
class MimeLiteClient(ClientUpdate):
    """Steps with the server's SGDm state; sends ∇f_i(x).

    Metric ``<name>-grad-norm``: ‖∇f_i(x)‖, this client's full-batch
    gradient at the global model.
    """

    name: ClassVar[str] = "mimelite"
    server: ClassVar[type[MimeLite]] = MimeLite

    def begin(self, start: LocalStart) -> None:
        """Read β, m (and c); compute ∇f_i(x) on a frozen copy of x."""
        beta = start.config.get(self.server.key(BETA))
        if isinstance(beta, bool) or not isinstance(beta, int | float):
            beta = None
        if beta is None or not 0 <= beta < 1:
            raise ValueError(
                f"the train config's {self.server.key(BETA)} must be a number in "
                f"[0, 1), got {start.config.get(self.server.key(BETA))!r} (the "
                f"server half, fedadapt.strategies.{self.server.__name__}, sends it)"
            )
        self.beta = float(beta)
        at_x = copy.deepcopy(start.model).train()
        self.criterion = start.criterion
        params = dict(start.model.named_parameters())
        params = {n: p for n, p in params.items() if p.requires_grad}
        self.m = self._server_arrays(start.arrays, MOMENTUM, params)
        self.c = self._server_arrays(start.arrays, CORRECTION, params)
        unknown = sorted(
            k for k in start.arrays if not k.startswith((MOMENTUM, CORRECTION))
        )
        if unknown or (self.c is not None and not self.server.corrected):
            extra = unknown or [CORRECTION + "*"]
            raise ValueError(f"{self.name}: unexpected server arrays {extra}")
        self.grad_x = full_batch_gradient(
            at_x, start.criterion, start.data, start.batch_size, start.device
        )
        #: the frozen copy of x for ∇f_i(x; ζ), kept only while c corrects
        self.at_x = at_x if self.c is not None else None

    def _server_arrays(
        self,
        arrays: Mapping[str, np.ndarray],
        prefix: str,
        params: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor] | None:
        """Return the server's ``prefix`` arrays like ``params`` (None: none sent)."""
        sent = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
        if not sent:
            return None
        if set(sent) != set(params) or any(
            np.shape(v) != tuple(params[n].shape) for n, v in sent.items()
        ):
            raise ValueError(
                f"{self.name}: the server's {prefix}* arrays do not match this "
                f"model's trainable parameters {sorted(params)} (names and shapes)"
            )
        return {n: torch.as_tensor(v).to(params[n]) for n, v in sent.items()}

    def after_backward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """p.grad ← (1 − β)·g + β·m (Mime: g gains −∇f_i(x; ζ) + c)."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        at_x = None
        if self.at_x is not None:
            x_params = [p for p in self.at_x.parameters() if p.requires_grad]
            loss = self.criterion(self.at_x(inputs), targets)
            at_x = torch.autograd.grad(loss, x_params, allow_unused=True)
        with torch.no_grad():
            for i, (name, p) in enumerate(params):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if at_x is not None and self.c is not None:
                    g_x = at_x[i]
                    g = (g if g_x is None else g - g_x) + self.c[name]
                d = g * (1.0 - self.beta)
                if self.m is not None:
                    d = d + self.m[name] * self.beta
                p.grad = d

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """Send ∇f_i(x), one array per trainable parameter."""
        arrays = {n: g.detach().cpu().numpy() for n, g in self.grad_x.items()}
        squares = [torch.sum(g.double() ** 2) for g in self.grad_x.values()]
        norm = float(torch.stack(squares).sum().sqrt())
        return LocalEnd(arrays=arrays, metrics={f"{self.name}-grad-norm": norm})


@CLIENT_UPDATES.register("mime")
class MimeClient(MimeLiteClient):
    """Mime: MimeLite's step on the SVRG-corrected gradient g − ∇f_i(x; ζ) + c."""

    name: ClassVar[str] = "mime"
    server: ClassVar[type[MimeLite]] = Mime
