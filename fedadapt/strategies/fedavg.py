"""FedAvg and FedAvgM [McMahan et al., 2017; Hsu et al., 2019].

Papers: arxiv.org/abs/1602.05629, arxiv.org/abs/1909.06335. Drop-in
replacements for ``flwr.serverapp.strategy.FedAvg`` / ``FedAvgM``: same
arguments, same sampling and configuration, plus reply screening, per-round
reports, integer arrays kept integer, and checkpointable state.
"""

from __future__ import annotations

from typing import Unpack

from flwr.serverapp import strategy as flwr_strategy

from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies.core import FedAvgRule


class FedAvg(RuleStrategy, flwr_strategy.FedAvg):
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
        super().__init__(**kwargs)
        self.rule = FedAvgRule(weighting=weighting)


class FedAvgM(RuleStrategy, flwr_strategy.FedAvgM):
    """FedAvg with server learning rate and heavy-ball momentum (as Flower's).

    Parameters
    ----------
    server_learning_rate : float (default: 1.0)
        η_g > 0.
    server_momentum : float (default: 0.0)
        β in [0, 1); DUA's FedAvgM baseline uses 0.9 (A-F14).
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
        super().__init__(
            server_learning_rate=server_learning_rate,
            server_momentum=server_momentum,
            **kwargs,
        )
        self.rule = FedAvgRule(
            server_lr=server_learning_rate,
            server_momentum=server_momentum,
            weighting=weighting,
        )
