"""The interface of a framework-free server update rule.

A :class:`ServerRule` turns one round's statistics (Δ̄_t and, when it needs
it, A_t; :class:`RoundStatistics`) into new adaptive arrays
(:meth:`ServerRule.update`) and saves/restores its state (moments). How the
statistics are formed from client arrays (weighting, the server's own norms,
clipping, robust aggregation) and applied to every array lives in
:mod:`fedadapt.strategies.core.aggregation`; :meth:`ServerRule.step` runs
both, the pure-math entry point.

Which arrays are adaptive: floating-point arrays, minus the keys selected by
``plain_average`` (by default nothing; FedExP/FedDuA exclude BatchNorm
buffers, which are running statistics rather than trained parameters).
Plain arrays are averaged (integers rounded back to their dtype) and kept
out of norms and preconditioners. :func:`untrained` turns a user's
``trainable`` (names or a predicate) into such a ``plain_average``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedadapt._validation import check_choice
from fedadapt.strategies.core.aggregation import (
    AGGREGATIONS,
    Arrays,
    RoundStatistics,
    apply_statistics,
    client_weights,
    round_statistics,
    sq_norm,
)

__all__ = [
    "AGGREGATIONS",
    "BATCHNORM_BUFFER_SUFFIXES",
    "WEIGHTINGS",
    "Arrays",
    "RoundStatistics",
    "ServerRule",
    "Trainable",
    "client_weights",
    "is_batchnorm_buffer",
    "sq_norm",
    "untrained",
    "zeros_like",
]

WEIGHTINGS = ("uniform", "num_examples")
BATCHNORM_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def is_batchnorm_buffer(key: str) -> bool:
    """Return True for PyTorch BatchNorm buffer names (``*.running_mean`` …)."""
    return key.rsplit(".", 1)[-1] in BATCHNORM_BUFFER_SUFFIXES


#: Which arrays are trained: a collection of array names, or a predicate
#: ``name -> bool`` (True: trained).
Trainable = Collection[str] | Callable[[str], bool]


def untrained(trainable: Trainable) -> Callable[[str], bool]:
    """Return the ``plain_average`` predicate of ``trainable`` (our choice).

    ``trainable`` names the arrays that are trained (a collection of names,
    e.g. ``[n for n, _ in model.named_parameters()]``) or is a predicate
    that says so per name. The returned predicate is True for every other
    array: those are averaged and kept out of Δ̄'s adaptive part, the
    preconditioners and the norms. Non-float arrays are never trained,
    whatever ``trainable`` says.
    """
    if callable(trainable):
        predicate = trainable
        return lambda key: not predicate(key)
    if isinstance(trainable, str | bytes) or not isinstance(trainable, Collection):
        raise TypeError(
            "trainable must be a collection of array names or a callable "
            f"name -> bool, got {type(trainable).__name__}"
        )
    names = frozenset(trainable)
    if not all(isinstance(n, str) for n in names):
        raise TypeError("trainable names must be strings")
    return lambda key: key not in names


class ServerRule(ABC):
    """One server update rule over NumPy arrays, with ``state_dict`` support.

    Parameters
    ----------
    weighting : str (default: "uniform")
        ``"uniform"`` (the papers) or ``"num_examples"`` (Flower), used for
        both Δ̄ and A so that A ≥ ‖Δ̄‖² (Jensen) holds.
    plain_average : Callable[[str], bool] | None (default: None)
        Keys for which the rule is skipped: they are averaged, and left out
        of norms and preconditioners. Non-float arrays always are. A
        strategy's ``trainable`` argument replaces it (:func:`untrained`).
    """

    #: whether :meth:`update` uses A_t (per-client squared update norms)
    needs_sq_norms: bool = False

    #: the step guard's leave-one-out step sizes of the last update, one per
    #: client in the order of the round's replies (None: no guard ran); the
    #: adapters write them to each reply's record (clients.jsonl)
    leave_one_out_steps: list[float] | None = None

    def __init__(
        self,
        *,
        weighting: str = "uniform",
        plain_average: Callable[[str], bool] | None = None,
    ) -> None:
        self.weighting = check_choice("weighting", weighting, WEIGHTINGS)
        self.plain_average = plain_average
        self.num_updates = 0
        self._buffers: dict[tuple[int, np.dtype[Any]], NDArray[Any]] = {}

    # --- the rule itself -----------------------------------------------------

    @abstractmethod
    def update(
        self, current: Arrays, stats: RoundStatistics
    ) -> tuple[Arrays, dict[str, float]]:
        """Return the new adaptive arrays and scalar diagnostics.

        ``current`` and ``stats.mean_update`` hold only the adaptive keys.
        """

    def _state(self) -> dict[str, Any]:
        """Return the rule's own state (moments); override with ``_load``."""
        return {}

    def _load(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore what :meth:`_state` returned."""

    @property
    def robust_aggregation(self) -> str:
        """The aggregator ``aggregation="auto"`` (the strategies' default) uses.

        The one measured to keep this rule within issue #38's bars against
        one hostile client of ten (every attack of the suite at most 2
        accuracy points, honest runs within 0.5 of the mean's, digits-mlp
        and mnist5k-cnn; docs/robustness.md). Where none does, the one that
        lowers the worst attack most while keeping honest runs within 0.5
        points of the mean's on both tasks (Fed-LAMB), or ``"mean"`` where
        every aggregator costs honest runs more: then the rule steps on the
        papers' mean.
        """
        return "mean"

    # --- shared machinery ------------------------------------------------------

    def __repr__(self) -> str:
        """Name and hyperparameters: ``FedAdamRule(eta=0.1, ...)``."""
        names = inspect.signature(type(self)).parameters
        shown = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in names
            if name != "plain_average" and hasattr(self, name)
        )
        return f"{type(self).__name__}({shown})"

    def scratch(self, like: NDArray[Any], slot: int = 0) -> NDArray[Any]:
        """Return a work array shaped like ``like`` (contents undefined).

        One flat buffer per ``slot`` and dtype, grown to the largest key and
        kept across keys and rounds, so the server step allocates (and the
        OS zero-fills) no per-key temporaries. Not part of the state.
        """
        key = (slot, like.dtype)
        flat = self._buffers.get(key)
        if flat is None or flat.size < like.size:
            flat = self._buffers[key] = np.empty(like.size, like.dtype)
        return flat[: like.size].reshape(like.shape)

    def adaptive_keys(self, current: Mapping[str, NDArray[Any]]) -> list[str]:
        """Return the keys the rule updates (floating point, not plain-averaged)."""
        return [
            k
            for k, a in current.items()
            if a.dtype.kind == "f"
            and not (self.plain_average is not None and self.plain_average(k))
        ]

    def step(
        self,
        current: Mapping[str, NDArray[Any]],
        clients: Sequence[Mapping[str, NDArray[Any]]],
        num_examples: Sequence[float],
        sq_norms: Sequence[float] | None = None,
        *,
        num_nodes: int | None = None,
    ) -> tuple[Arrays, dict[str, float]]:
        """Aggregate one round of client arrays; return new arrays, diagnostics.

        The pure-math entry point: ``round_statistics`` (the weighted mean,
        no clipping) then ``apply_statistics``, both of
        :mod:`fedadapt.strategies.core.aggregation`. ``sq_norms``:
        client-reported ‖Δ_i‖², used as given; ``num_nodes``: the
        federation's client count N (:attr:`RoundStatistics.num_nodes`).
        """
        stats = round_statistics(self, current, clients, num_examples, sq_norms)
        stats = dataclasses.replace(stats, num_nodes=num_nodes)
        return apply_statistics(self, current, stats)

    def state_dict(self) -> dict[str, Any]:
        """Return a deep copy of the rule's state (moments, step count)."""
        return copy.deepcopy({"num_updates": self.num_updates, **self._state()})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state returned by :meth:`state_dict`."""
        restored = copy.deepcopy(dict(state))
        self.num_updates = int(restored.pop("num_updates"))
        self._load(restored)


def zeros_like(arrays: Mapping[str, NDArray[Any]]) -> Arrays:
    """Return zero arrays shaped like ``arrays`` (lazy moment initialisation)."""
    return {k: np.zeros_like(a) for k, a in arrays.items()}
