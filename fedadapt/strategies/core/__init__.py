"""Framework-free server update rules over NumPy arrays (no Flower, no torch).

Each rule's ``step(current, clients, num_examples, sq_norms=None)`` returns the
new global arrays and per-round diagnostics; :func:`apply_statistics` does the
same from the round's sums alone (secure aggregation), :func:`round_statistics`
forms them with clipping and robust aggregation (:mod:`.aggregation`). State
round-trips via ``state_dict()`` / ``load_state_dict()``.
"""

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
from fedadapt.strategies.core.fedavg import FedAvgRule
from fedadapt.strategies.core.feddua import FedDuARule
from fedadapt.strategies.core.fedexp import FedExPRule
from fedadapt.strategies.core.fedlamb import FedLAMBRule, aggregate_second_moments
from fedadapt.strategies.core.fedopt import (
    FedAdagradRule,
    FedAdamRule,
    FedOptRule,
    FedYogiRule,
)

__all__ = [
    "Arrays",
    "FedAdagradRule",
    "FedAdamRule",
    "FedAvgRule",
    "FedDuARule",
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
