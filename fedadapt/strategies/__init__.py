"""Server strategies for Flower: change one import to use them.

Message API (Flower ≥ 1.20, ``ServerApp`` + ``strategy.start``)::

    from fedadapt.strategies import FedDuA, FedExP, FedAdam, FedYogi, FedLAMB

Legacy API (``ServerApp(server_fn=...)`` + ``NumPyClient``)::

    from fedadapt.strategies.legacy import FedDuA, ...

Each algorithm is one file (``fedavg.py``, ``fedopt.py``, ``fedexp.py``,
``feddua.py``, ``fedlamb.py``, ``feddyn.py``): its NumPy-only update rule
and one :class:`~fedadapt.strategies.declaration.Algorithm` declaration of
its hyperparameters (and of its own client part, if any), from which both
classes, the app's run-config keys (``<strategy>.<param>``) and the docs
tables are generated; :data:`ALGORITHMS` lists them by run-config name.
Your own rule: subclass :class:`ServerRule` and wrap it in
:class:`RuleStrategy` (or ``fedadapt.strategies.legacy.LegacyRuleStrategy``).
An algorithm's client-side part (FedProx's proximal term, …) is a
:class:`LocalUpdate` given to any strategy:
``FedAvg(local_update=FedProx(mu=0.01))``, ``FedDuA(local_update=Scaffold())``;
an algorithm with both halves declares its own (FedDyn's
:class:`FedDynLocal`, Fed-LAMB's :class:`SecondMoments`), which its
strategy always runs, combined with a given one (:class:`LocalUpdates`).
docs/extending.md is the recipe for all three kinds.
A run whose replies all fail for ``max_failed_rounds`` rounds ends with
:class:`FederationFailedError`. Importable with flwr and numpy alone:
nothing here imports torch.
"""

from fedadapt.registry import Registry
from fedadapt.strategies._message_api import RuleStrategy
from fedadapt.strategies._records import records_from_bytes, records_to_bytes
from fedadapt.strategies.adapter import FederationFailedError
from fedadapt.strategies.core import RoundStatistics, ServerRule
from fedadapt.strategies.declaration import Algorithm, Param
from fedadapt.strategies.fedavg import FEDAVG, FEDAVGM, FedAvg, FedAvgM
from fedadapt.strategies.feddua import FEDDUA, FedDuA
from fedadapt.strategies.feddyn import FEDDYN, FedDyn, FedDynLocal
from fedadapt.strategies.fedexp import FEDEXP, FEDEXPM, FedExP, FedExPM
from fedadapt.strategies.fedlamb import FED_LAMB, FedLAMB, SecondMoments
from fedadapt.strategies.fedopt import (
    FEDADAGRAD,
    FEDADAM,
    FEDYOGI,
    FedAdagrad,
    FedAdam,
    FedYogi,
)
from fedadapt.strategies.fedprox import FedProx
from fedadapt.strategies.local_update import LOCAL_UPDATES, LocalUpdate, LocalUpdates
from fedadapt.strategies.mime import Mime, MimeLite
from fedadapt.strategies.moon import Moon
from fedadapt.strategies.scaffold import Scaffold
from fedadapt.strategies.screening import reject_reason

#: The declared algorithms by run-config ``strategy`` name (in this order in
#: the docs). A built-in one is added to the tuple below. Registering one
#: later (``ALGORITHMS.register(name)(algorithm)``) works only before
#: :mod:`fedadapt.config` is imported: that module builds the run-config keys
#: and choices from this registry once and then freezes it, so a later
#: registration raises instead of being silently unselectable.
ALGORITHMS: Registry[Algorithm] = Registry("strategy")
for _algorithm in (
    FEDAVG, FEDAVGM, FEDADAM, FEDADAGRAD, FEDYOGI, FEDEXP, FEDEXPM, FEDDUA, FED_LAMB,
    FEDDYN,
):  # fmt: skip
    ALGORITHMS.register(_algorithm.name)(_algorithm)


def server_halves() -> dict[str, type[LocalUpdate]]:
    """Return every known local update's server half by its wire name.

    The ``local-update=`` choices (:data:`LOCAL_UPDATES`) and the
    algorithms' own client parts (:attr:`Algorithm.local_update`); their
    client halves are registered under the same names.
    """
    halves = {name: LOCAL_UPDATES.get(name) for name in LOCAL_UPDATES.names()}
    for name in ALGORITHMS.names():
        own = ALGORITHMS.get(name).local_update
        if own is not None:
            halves.setdefault(own.name, own)
    return halves


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedDuA",
    "FedDyn",
    "FedDynLocal",
    "FedExP",
    "FedExPM",
    "FedLAMB",
    "FedProx",
    "FedYogi",
    "FederationFailedError",
    "Param",
    "LocalUpdate",
    "LocalUpdates",
    "Mime",
    "MimeLite",
    "Moon",
    "RoundStatistics",
    "RuleStrategy",
    "Scaffold",
    "SecondMoments",
    "ServerRule",
    "records_from_bytes",
    "records_to_bytes",
    "reject_reason",
    "server_halves",
]
