"""Server strategies for Flower: change one import to use them.

Message API (Flower ≥ 1.20, ``ServerApp`` + ``strategy.start``)::

    from fedadapt.strategies import FedDuA, FedExP, FedAdam, FedYogi, FedLAMB

Legacy API (``ServerApp(server_fn=...)`` + ``NumPyClient``)::

    from fedadapt.strategies.legacy import FedDuA, ...

The update rules themselves live in :mod:`fedadapt.strategies.core` (NumPy
only). Your own rule: subclass :class:`ServerRule` and wrap it in
:class:`RuleStrategy` (or ``fedadapt.strategies.legacy.LegacyRuleStrategy``).
An algorithm's client-side part (FedProx's proximal term, …) is a
:class:`LocalUpdate` given to any strategy: ``FedAvg(local_update=FedProx(mu=0.01))``.
A run whose replies all fail for ``max_failed_rounds`` rounds ends with
:class:`FederationFailedError`. Importable with flwr and numpy alone:
nothing here imports torch.
"""

from fedadapt.strategies._message_api import RuleStrategy
from fedadapt.strategies._records import records_from_bytes, records_to_bytes
from fedadapt.strategies._screening import FederationFailedError, reject_reason
from fedadapt.strategies.core import RoundStatistics, ServerRule
from fedadapt.strategies.fedavg import FedAvg, FedAvgM
from fedadapt.strategies.feddua import FedDuA
from fedadapt.strategies.fedexp import FedExP
from fedadapt.strategies.fedlamb import FedLAMB
from fedadapt.strategies.fedopt import FedAdagrad, FedAdam, FedYogi
from fedadapt.strategies.fedprox import FedProx
from fedadapt.strategies.local_update import LocalUpdate

__all__ = [
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedDuA",
    "FedExP",
    "FedLAMB",
    "FedProx",
    "FedYogi",
    "FederationFailedError",
    "LocalUpdate",
    "RoundStatistics",
    "RuleStrategy",
    "ServerRule",
    "records_from_bytes",
    "records_to_bytes",
    "reject_reason",
]
