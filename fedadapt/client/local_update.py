"""The client half of an algorithm's client-side part (a *local update*).

The server half (:class:`fedadapt.strategies.local_update.LocalUpdate`)
names the client half in the train config
(:data:`~fedadapt.strategies.wire.LOCAL_UPDATE`); the ClientApp and the
NumPyClient look it up in :data:`CLIENT_UPDATES` and apply it through
:func:`fedadapt.client.local.train_round` and
:func:`fedadapt.client.training.train_local` (one code path for both
APIs). A round runs

1. :meth:`ClientUpdate.begin` with a :class:`LocalStart`: the model at the
   global x_t, the server's config and arrays, this client's state from its
   last round (None the first time), its data (for a full-batch gradient)
   and the round's optimizer;
2. per local step, inside the optimizer's closure (so a re-evaluating
   optimizer such as Δ-SGD's same-batch mode sees it in every pass):
   :meth:`ClientUpdate.loss_term` added to the task loss before
   ``backward``, then :meth:`ClientUpdate.after_backward` on the gradients
   (after gradient clipping and weight decay);
3. :meth:`ClientUpdate.end` with the trained model and the number of local
   steps: arrays and metrics sent back, and the client state kept for the
   next round.

The client state lives in Flower's ``Context.state`` (kept per node and run
by the simulation and by a SuperNode) as the records of
:func:`fedadapt.strategies._records.state_to_records`; a state that cannot
be read back, or that :meth:`ClientUpdate.check_state` refuses, is reset
(the client half starts fresh), logged and reported as the train metric
:data:`~fedadapt.strategies.wire.LOCAL_STATE_RESET` = 1.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import RecordDict
from flwr.common.logger import log
from torch import nn
from torch.utils.data import Dataset

from fedadapt.registry import Registry
from fedadapt.strategies import wire
from fedadapt.strategies._records import state_from_records, state_to_records
from fedadapt.strategies.local_update import MEMBER, SEPARATOR, split_arrays

__all__ = [
    "CLIENT_UPDATES",
    "ClientUpdate",
    "ClientUpdates",
    "LocalEnd",
    "LocalStart",
    "client_half",
    "client_update",
    "load_client_state",
    "log_state_reset",
    "save_client_state",
]


@dataclass
class LocalStart:
    """What a client half sees when a round starts."""

    model: nn.Module  #: the model to train, at the global x_t (on ``device``)
    config: Mapping[str, Any]  #: the server's train config (``<name>.<param>``)
    arrays: Mapping[str, np.ndarray]  #: the server half's arrays
    state: dict[str, Any] | None  #: this client's state (None: first round)
    data: Dataset  #: the local train split
    criterion: nn.Module  #: the task loss
    batch_size: int
    device: torch.device
    server_round: int
    lr: float  #: the round's client learning rate η_l (after its decay)
    #: True when a kept state could not be used and was reset (``state`` is
    #: then None): the client half can tell a lost state from a first round
    state_reset: bool = False
    #: the round's client optimizer, built before :meth:`ClientUpdate.begin`
    #: (Fed-LAMB's half loads v̂ into it); None where a caller has none
    optimizer: torch.optim.Optimizer | None = None


@dataclass
class LocalEnd:
    """What a client half returns when the round ends."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)  #: sent back
    metrics: dict[str, float] = field(default_factory=dict)  #: added to the reply's
    state: dict[str, Any] | None = None  #: kept for the next round (None: none)


class ClientUpdate:
    """Client half of a local update; this base class changes nothing.

    One instance serves one client for one round. Override what the
    algorithm needs; tensors stay on the model's device.
    """

    #: registry name, the server half's :attr:`LocalUpdate.name`
    name: ClassVar[str] = "none"

    def begin(self, start: LocalStart) -> None:  # noqa: B027 (optional hook)
        """Take the round's inputs (copy what must survive training)."""

    def check_state(self, state: Mapping[str, Any]) -> str | None:
        """Return why a stored client state is unusable (then it is reset), or None."""
        return None

    def loss_term(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        outputs: torch.Tensor,
    ) -> torch.Tensor | None:
        """Return a term added to the task loss of this batch (None: nothing)."""
        return None

    def after_backward(  # noqa: B027 (optional hook)
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """Change the gradients in ``p.grad`` before the optimizer steps."""

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """Return the arrays, metrics and state of the round.

        ``model`` is the trained model, ``steps`` the local steps taken (K).
        """
        return LocalEnd()


#: name → client half; the server half of the same name sends its config
CLIENT_UPDATES: Registry[type[ClientUpdate]] = Registry("local-update")
CLIENT_UPDATES.register("none")(ClientUpdate)


class ClientUpdates(ClientUpdate):
    """The client halves of combined local updates, applied in order.

    The client side of :class:`fedadapt.strategies.local_update.LocalUpdates`:
    each member sees its own arrays (``<name>/<key>``) and state; loss terms
    are summed, gradients changed in order, the members' arrays sent back
    keyed ``<name>/<key>``, their states kept as ``{name: state}``.
    """

    def __init__(self, updates: list[ClientUpdate]) -> None:
        self.updates = updates
        # the instance's wire name (the base declares it per class)
        self.name = SEPARATOR.join(u.name for u in updates)  # type: ignore[misc]

    def begin(self, start: LocalStart) -> None:
        """Begin each member with its own arrays and state."""
        parts, unknown = split_arrays(start.arrays, [u.name for u in self.updates])
        if unknown:
            raise ValueError(
                f"local-update array '{unknown[0]}' names none of {self.name}"
            )
        state = start.state or {}
        for update in self.updates:
            own = replace(
                start, arrays=parts[update.name], state=state.get(update.name)
            )
            update.begin(own)

    def check_state(self, state: Mapping[str, Any]) -> str | None:
        """Return the first member's reason to refuse its state, or None."""
        for update in self.updates:
            own = state.get(update.name)
            reason = None if own is None else update.check_state(own)
            if reason is not None:
                return f"{update.name}: {reason}"
        return None

    def loss_term(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        outputs: torch.Tensor,
    ) -> torch.Tensor | None:
        """Return the sum of the members' terms (None: none has one)."""
        total = None
        for update in self.updates:
            term = update.loss_term(model, inputs, targets, outputs)
            if term is not None:
                total = term if total is None else total + term
        return total

    def after_backward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """Each member changes the gradients, in order."""
        for update in self.updates:
            update.after_backward(model, inputs, targets)

    def end(self, model: nn.Module, steps: int) -> LocalEnd:
        """Return the members' arrays (``<name>/<key>``), metrics and states."""
        result = LocalEnd()
        states: dict[str, Any] = {}
        for update in self.updates:
            own = update.end(model, steps)
            result.arrays.update(
                {f"{update.name}{MEMBER}{k}": a for k, a in own.arrays.items()}
            )
            result.metrics.update(own.metrics)
            if own.state is not None:
                states[update.name] = own.state
        result.state = states or None
        return result


def client_update(config: Mapping[str, Any]) -> ClientUpdate | None:
    """Return the client half the server's train config names (None: plain).

    Names joined by ``+`` (combined local updates) give a
    :class:`ClientUpdates` of their client halves.
    """
    name = config.get(wire.LOCAL_UPDATE, "none")
    if name == "none":
        return None
    if not isinstance(name, str):
        raise TypeError(f"'{wire.LOCAL_UPDATE}' in the train config must be a name")
    updates = [client_half(n)() for n in name.split(SEPARATOR)]
    return updates[0] if len(updates) == 1 else ClientUpdates(updates)


def client_half(name: str) -> type[ClientUpdate]:
    """Return the client half registered as ``name``, importing it if needed.

    A name not registered yet is looked up among the known server halves
    (:func:`fedadapt.strategies.server_halves`); the module their
    :attr:`~fedadapt.strategies.local_update.LocalUpdate.client_module`
    names is imported, which registers the client half. So a new built-in
    algorithm needs no import list on the client side.
    """
    if name not in CLIENT_UPDATES.names():
        from fedadapt.strategies import server_halves

        server = server_halves().get(name)
        if server is not None and server.client_module is not None:
            importlib.import_module(server.client_module)
    return CLIENT_UPDATES.get(name)


def _record_name(update: ClientUpdate) -> str:
    return f"{wire.LOCAL_UPDATE}.{update.name}"


def load_client_state(
    records: RecordDict | None, update: ClientUpdate
) -> tuple[dict[str, Any] | None, bool]:
    """Return (the client state kept in ``records``, whether it was reset).

    No state yet gives ``(None, False)``; a state that cannot be read or
    that ``update`` refuses gives ``(None, True)``, logged.
    """
    name = _record_name(update)
    if records is None or f"{name}.layout" not in records:
        return None, False
    try:
        state = state_from_records(records, name)
        reason = update.check_state(state)
    except (KeyError, TypeError, ValueError) as error:
        reason = f"unreadable ({error})"
    if reason is None:
        return state, False
    log_state_reset(update, reason)
    return None, True


def log_state_reset(update: ClientUpdate, reason: str) -> None:
    """Log that ``update``'s client state is reset, and why.

    :func:`load_client_state` calls it; a client half that finds its state
    unusable only in :meth:`ClientUpdate.begin` (e.g. against the model's
    shapes) calls it too and reports :data:`~fedadapt.strategies.wire.LOCAL_STATE_RESET`
    = 1 in :attr:`LocalEnd.metrics`.
    """
    log(
        WARNING,
        "fedadapt: local update %s: client state reset: %s",
        update.name,
        reason,
    )


def save_client_state(
    records: RecordDict | None, update: ClientUpdate, state: Mapping[str, Any] | None
) -> None:
    """Replace the client state of ``update`` in ``records`` (None: remove it)."""
    if records is None:
        return
    name = _record_name(update)
    for suffix in (".arrays", ".values", ".layout"):
        records.pop(name + suffix, None)
    if state is not None:
        records.update(state_to_records(state, name))
