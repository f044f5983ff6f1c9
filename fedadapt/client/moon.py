"""MOON's client half (Li, He and Song, CVPR 2021, Algorithm 1 lines 23-27).

Each local loss gains μ·ℓ_con (eq. 3-4):

    ℓ_con = −log( exp(sim(z, z_glob)/τ)
                  / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

z the representation of the batch under the model being trained, z_glob
under the received global model w_t, z_prev under this client's model after
its previous local training w_i^{t−1}; sim is the cosine similarity. The
representation is the input of the model's last Linear layer
(:func:`fedadapt.tasks.models.representation_layer`). The term is added
inside the optimizer's closure, so Δ-SGD's same-batch second pass includes
it (with the same frozen z_glob, z_prev, as the Δ-SGD code).

Our choices where the paper leaves room (docs/algorithms.md):

- first participation (no previous model yet): z_prev = z_glob, as the
  Δ-SGD code (``prev_local_nets[idx] = global_model.state_dict()``); then
  ℓ_con = log 2 and its gradient is 0;
- the two frozen models run in eval mode (no dropout, BatchNorm's running
  statistics), as the MOON code's ``global_model.eval()``;
- the client state is the trained model's state_dict (parameters and
  buffers), kept in the node's ``Context.state``; one that is unreadable,
  not finite or not of the model's keys and shapes is reset to the global
  model, logged and counted (metric ``local-update-state-reset``).

The server half is :class:`fedadapt.strategies.moon.Moon`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.client.local_update import (
    CLIENT_UPDATES,
    ClientUpdate,
    LocalEnd,
    LocalStart,
    log_state_reset,
)
from fedadapt.strategies import wire
from fedadapt.strategies.moon import MU, TEMPERATURE, Moon
from fedadapt.strategies.param import Param
from fedadapt.tasks.models import representation, representation_layer

__all__ = ["MoonClient", "contrastive_loss"]


def contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float
) -> torch.Tensor:
    """ℓ_con of MOON eq. 3, averaged over the batch (rows of the ``(N, d)`` inputs).

    Cross-entropy of the logits (sim(z, z_glob), sim(z, z_prev))/τ with the
    first as the target, as the MOON code computes it.
    """
    positive = F.cosine_similarity(z, z_glob, dim=-1)
    negative = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack((positive, negative), dim=1) / temperature
    target = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, target)


def _frozen(model: nn.Module, state: Mapping[str, np.ndarray] | None) -> nn.Module:
    """Return a copy of ``model`` (``state`` loaded), in eval mode, frozen."""
    frozen = copy.deepcopy(model)
    if state is not None:
        frozen.load_state_dict(
            {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}
        )
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def _mismatch(state: Mapping[str, np.ndarray], model: nn.Module) -> str | None:
    """Return why ``state`` is no state_dict of ``model`` (keys, shapes, dtypes)."""
    expected = model.state_dict()
    if set(state) != set(expected):
        return "its arrays are not the model's state_dict keys"
    for key, tensor in expected.items():
        array = state[key]
        if tuple(array.shape) != tuple(tensor.shape):
            return (
                f"{key} has shape {tuple(array.shape)}, the model {tuple(tensor.shape)}"
            )
        if array.dtype != torch.empty(0, dtype=tensor.dtype).numpy().dtype:
            return f"{key} has dtype {array.dtype}, the model {tensor.dtype}"
    return None


def _config(config: Mapping[str, Any], param: Param) -> float:
    """``config[moon.<param>]`` checked against the declaration, or ValueError."""
    key = Moon.key(param)
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"the train config's {key} must be a number, got {value!r} "
            "(the server half, fedadapt.strategies.Moon, sends it)"
        )
    return float(param.check(float(value)))


@CLIENT_UPDATES.register("moon")
class MoonClient(ClientUpdate):
    """Adds μ·ℓ_con (MOON eq. 4) to the local loss; keeps the trained model.

    Metric ``moon-term``: μ·ℓ_con at the current iterate, averaged over the
    local steps.
    """

    name: ClassVar[str] = "moon"

    def begin(self, start: LocalStart) -> None:
        """Freeze w_t and w_i^{t−1} (or w_t at a first participation); hook z."""
        self.mu = _config(start.config, MU)
        self.temperature = _config(start.config, TEMPERATURE)
        model = start.model
        self.global_model = _frozen(model, None)
        previous = None if start.state is None else start.state["model"]
        self.reset = False
        if previous is not None:
            reason = _mismatch(previous, model)
            if reason is not None:
                log_state_reset(self, reason)
                self.reset, previous = True, None
        self.previous_model = (
            self.global_model if previous is None else _frozen(model, previous)
        )
        self._z: torch.Tensor | None = None
        self._hook = representation_layer(model).register_forward_pre_hook(
            self._capture
        )
        self._inputs: torch.Tensor | None = None
        self._z_glob = self._z_prev = torch.empty(0)
        self._term_sum = torch.zeros((), dtype=torch.float64, device=start.device)
        self._steps = 0

    def _capture(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._z = args[0]

    def check_state(self, state: Mapping[str, Any]) -> str | None:
        """Accept ``{"model": {key: finite array}}`` (shapes are checked in begin)."""
        arrays = state.get("model")
        if not isinstance(arrays, Mapping) or not arrays:
            return "no 'model' arrays"
        for key, array in arrays.items():
            if not isinstance(array, np.ndarray):
                return f"{key} is not an array"
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                return f"{key} is not finite"
        return None

    def loss_term(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        outputs: torch.Tensor,
    ) -> torch.Tensor:
        """μ·ℓ_con of this batch; z from the closure's forward pass."""
        if self._z is None:
            raise RuntimeError("MOON's representation hook saw no forward pass")
        z, self._z = self._z.flatten(1), None
        first_pass = inputs is not self._inputs
        if first_pass:  # a new batch: the frozen models' z, reused by Δ-SGD's 2nd pass
            self._inputs = inputs
            with torch.no_grad():
                self._z_glob = representation(self.global_model, inputs)[0]
                self._z_prev = (
                    self._z_glob
                    if self.previous_model is self.global_model
                    else representation(self.previous_model, inputs)[0]
                )
        term = self.mu * contrastive_loss(
            z, self._z_glob, self._z_prev, self.temperature
        )
        if first_pass:
            self._term_sum += term.detach().double()
            self._steps += 1
        return term

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """Keep the trained model as the next w_i^{t−1}; report ``moon-term``."""
        self._hook.remove()
        metrics: dict[str, float] = {
            "moon-term": float(self._term_sum) / max(self._steps, 1)
        }
        if self.reset:
            metrics[wire.LOCAL_STATE_RESET] = 1
        state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        return LocalEnd(metrics=metrics, state={"model": state})
