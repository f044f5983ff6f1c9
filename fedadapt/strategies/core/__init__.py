"""Framework-free server update rules over NumPy arrays (no Flower, no torch).

Each rule's ``step(current, clients, num_examples, sq_norms=None)`` returns the
new global arrays and per-round diagnostics; :func:`apply_statistics` does the
same from the round's sums alone (secure aggregation), :func:`round_statistics`
forms them with clipping and robust aggregation (:mod:`.aggregation`).
State round-trips via ``state_dict()`` / ``load_state_dict()``.

The base pieces live here; each algorithm's rule lives in its own file with
its declaration (:mod:`fedadapt.strategies.feddua` …) and is re-exported
here by name for compatibility (loaded on first access, since those files
import this package).
"""

from __future__ import annotations

import importlib
from typing import Any

from fedadapt.strategies.core.aggregation import apply_statistics, round_statistics
from fedadapt.strategies.core.base import (
    Arrays,
    RoundStatistics,
    ServerRule,
    Trainable,
    client_weights,
    is_batchnorm_buffer,
    sq_norm,
    untrained,
)

#: rule name → the module of its algorithm
_RULES = {
    "FedAvgRule": "fedadapt.strategies.fedavg",
    "FedAdagradRule": "fedadapt.strategies.fedopt",
    "FedAdamRule": "fedadapt.strategies.fedopt",
    "FedOptRule": "fedadapt.strategies.fedopt",
    "FedYogiRule": "fedadapt.strategies.fedopt",
    "FedExPRule": "fedadapt.strategies.fedexp",
    "FedDuARule": "fedadapt.strategies.feddua",
    "FedDynRule": "fedadapt.strategies.feddyn",
    "FedLAMBRule": "fedadapt.strategies.fedlamb",
    "aggregate_second_moments": "fedadapt.strategies.fedlamb",
}


def __getattr__(name: str) -> Any:
    """Return a rule re-exported from its algorithm's module."""
    if name in _RULES:
        return getattr(importlib.import_module(_RULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Arrays",
    "FedAdagradRule",
    "FedAdamRule",
    "FedAvgRule",
    "FedDuARule",
    "FedDynRule",
    "FedExPRule",
    "FedLAMBRule",
    "FedOptRule",
    "FedYogiRule",
    "RoundStatistics",
    "ServerRule",
    "Trainable",
    "aggregate_second_moments",
    "apply_statistics",
    "client_weights",
    "is_batchnorm_buffer",
    "round_statistics",
    "sq_norm",
    "untrained",
]
