"""Optimizers that never import ``torch._dynamo`` (#40: a message's start-up).

``torch.optim.Optimizer`` wraps ``add_param_group`` (called by every
optimizer's ``__init__``) and ``zero_grad`` in ``torch._disable_dynamo``, and
the built-in optimizers' ``step`` in ``_use_grad_for_differentiable``; both
import ``torch._dynamo`` on their first call (1.7 s on 2 CPU cores, paid by
every deployment ClientApp process, which lives for one message). Out of
``torch.compile`` those wrappers do nothing else: ``_disable_dynamo`` calls
the function as it is when no frame is being compiled, and
``_use_grad_for_differentiable`` sets grad mode to the ``differentiable``
option around ``step`` and adds graph breaks, which mean nothing eagerly.

:class:`EagerOptimizer` (the base of fedadapt's own optimizers) and
:class:`SGD`, :class:`Adam`, :class:`Adagrad` (torch's, as the client
optimizer registry builds them) call the undecorated functions instead, with
the same grad mode: the same operations on the same tensors, so the same
numbers bit for bit. They are meant for eager training, which is what
fedadapt's clients do; under ``torch.compile`` use torch's own classes.

If a future torch drops the ``__wrapped__`` link of a wrapper, the decorated
function is called (slower start-up, same values);
``tests/optimizers/test_no_dynamo.py`` notices.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import Optimizer


def _undecorated(function: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``function`` without torch's wrappers (``__wrapped__``).

    Follows the whole chain: ``Optimizer._patch_step_function`` may have
    wrapped a class's ``step`` in its profiling hook as well.
    """
    return inspect.unwrap(function)


_ADD_PARAM_GROUP = _undecorated(Optimizer.add_param_group)
_ZERO_GRAD = _undecorated(Optimizer.zero_grad)


class EagerOptimizer(Optimizer):
    """``torch.optim.Optimizer`` whose group and gradient methods skip dynamo.

    ``add_param_group`` and ``zero_grad`` run torch's own code without the
    ``torch._disable_dynamo`` wrapper that imports ``torch._dynamo``.
    """

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Torch's ``add_param_group``, undecorated."""
        _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Torch's ``zero_grad``, undecorated."""
        _ZERO_GRAD(self, set_to_none)


class _EagerStep:
    """Mixin: call the torch optimizer's undecorated ``step`` in its grad mode.

    What ``_use_grad_for_differentiable`` does eagerly: grad mode set to the
    ``differentiable`` option during the step (the closure enables it for
    itself), restored after.
    """

    defaults: dict[str, Any]

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        raise NotImplementedError  # the torch optimizer's undecorated step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Torch's ``step``, undecorated, in the same grad mode."""
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return self._torch_step(closure)


class SGD(_EagerStep, EagerOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` without the ``torch._dynamo`` import (same values)."""

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        return _SGD_STEP(self, closure)


class Adam(_EagerStep, EagerOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` without the ``torch._dynamo`` import (same values)."""

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        return _ADAM_STEP(self, closure)


class Adagrad(_EagerStep, EagerOptimizer, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` without the ``torch._dynamo`` import (same values)."""

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        return _ADAGRAD_STEP(self, closure)


_SGD_STEP = _undecorated(torch.optim.SGD.step)
_ADAM_STEP = _undecorated(torch.optim.Adam.step)
_ADAGRAD_STEP = _undecorated(torch.optim.Adagrad.step)
