"""FedAvg and FedAvgM [McMahan et al., 2017; Hsu et al., 2019].

Papers: arXiv:1602.05629 (FedAvg, Algorithm 1), arXiv:1909.06335 (FedAvgM,
§3). Drop-in replacements for ``flwr.serverapp.strategy.FedAvg`` /
``FedAvgM``: same arguments, same sampling and configuration, plus reply
screening, per-round reports, integer arrays kept integer, and
checkpointable state.
"""

from __future__ import annotations

from typing import Unpack

from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies.core import FedAvgRule


class FedAvg(RuleStrategy):
    """FedAvg weighted by ``num-examples`` (Flower's behaviour).

    Parameters
    ----------
    weighting : str (default: "num_examples")
        ``"uniform"`` for the papers' unweighted mean.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self, *, weighting: str = "num_examples", **kwargs: Unpack[FedAvgKwargs]
    ) -> None:
        super().__init__(FedAvgRule(weighting=weighting), **kwargs)


class FedAvgM(RuleStrategy):
    """FedAvg with server learning rate and heavy-ball momentum (as Flower's).

    Parameters
    ----------
    server_learning_rate : float (default: 1.0)
        η_g > 0.
    server_momentum : float (default: 0.0)
        β in [0, 1). FedDuA's FedAvgM baseline (§5.1) gives no β; its
        suites use 0.9, the β_1 the paper fixes for FedDuAdam.
    weighting : str (default: "num_examples")
        ``"uniform"`` for the papers' unweighted mean.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        server_learning_rate: float = 1.0,
        server_momentum: float = 0.0,
        weighting: str = "num_examples",
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        rule = FedAvgRule(
            server_lr=server_learning_rate,
            server_momentum=server_momentum,
            weighting=weighting,
        )
        super().__init__(rule, **kwargs)
