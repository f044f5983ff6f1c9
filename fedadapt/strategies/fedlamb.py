"""Server side of Fed-LAMB and Fed-AMS (layer-wise locally adaptive FL).

Paper: "Layerwise and Dimensionwise Locally Adaptive Optimization Method"
(Fed-LAMB), Algorithm 1 lines 13-16. The rule is
:class:`fedadapt.strategies.core.FedLAMBRule` (model mean plus
v̂_r = max(v̂_{r−1}, Σω_i v_i)); this class only builds it. v̂ travels to the
clients, and each v_i back, as a second ArrayRecord named
``second-moments`` keyed by parameter name; in round 1 none is sent and
clients start from v̂_0 = ε·1.
"""

from __future__ import annotations

from typing import Unpack

from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies.core import FedLAMBRule

SECOND_MOMENTS_KEY = FedLAMBRule.client_state_key


class FedLAMB(RuleStrategy):
    """Model averaging plus v̂ = max(v̂, mean v) (Fed-LAMB and Fed-AMS servers).

    Parameters
    ----------
    eps : float (default: 1e-8)
        ε > 0 of the clients' optimizer; v̂_0 = ε·1 (Algorithm 1 line 2).
    weighting : str (default: "uniform")
        ω for both the models and v (Algorithm 1 lines 15-16).
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        eps: float = 1e-8,
        weighting: str = "uniform",
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        super().__init__(FedLAMBRule(eps=eps, weighting=weighting), **kwargs)
