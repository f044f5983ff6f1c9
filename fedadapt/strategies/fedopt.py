"""FedAdagrad, FedAdam and FedYogi [Reddi et al., 2021] for the Message API.

Paper: arXiv:2003.00295, Algorithm 2. Drop-in replacements for Flower 1.41's
``flwr.serverapp.strategy.FedAdagrad`` / ``FedAdam`` / ``FedYogi``: with the
same arguments they produce the same global arrays (Flower's num-examples
weighting, τ and FedAdam bias correction are the defaults). For the paper's
Algorithm 2 pass ``bias_correction="none", weighting="uniform"``. Integer
arrays (e.g. BatchNorm's ``num_batches_tracked``) are averaged and stay
integers instead of going through Adam as in Flower.
"""

from __future__ import annotations

from typing import Unpack

from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies.core import FedAdagradRule, FedAdamRule, FedYogiRule


class FedAdagrad(RuleStrategy):
    """FedAdagrad: ``v ← v + Δ̄²``, ``x ← x + η·Δ̄/(√v + τ)``.

    Parameters
    ----------
    eta : float (default: 1e-1)
        Server learning rate.
    eta_l : float (default: 1e-1)
        Client learning rate: accepted and kept as ``self.eta_l`` like
        Flower's, which does not send it either.
    tau : float (default: 1e-3)
        Adaptivity, added to √v.
    weighting : str (default: "num_examples")
        ``"uniform"`` for the paper.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        tau: float = 1e-3,
        weighting: str = "num_examples",
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        super().__init__(
            FedAdagradRule(eta=eta, tau=tau, weighting=weighting), **kwargs
        )
        self.eta_l = eta_l


class FedAdam(RuleStrategy):
    """FedAdam: Adam on the pseudo-gradient −Δ̄.

    Parameters
    ----------
    eta : float (default: 1e-1)
        Server learning rate.
    eta_l : float (default: 1e-1)
        Client learning rate (kept as ``self.eta_l``, not sent; as Flower).
    beta_1, beta_2 : float (default: 0.9, 0.99)
        Moment decay rates in [0, 1).
    tau : float (default: 1e-3)
        Adaptivity, added to √v.
    bias_correction : str (default: "flower")
        ``"flower"``, ``"none"`` (Reddi et al., FedDuA) or ``"torch"``.
    weighting : str (default: "num_examples")
        ``"uniform"`` for the paper.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        bias_correction: str = "flower",
        weighting: str = "num_examples",
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        rule = FedAdamRule(
            eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau,
            bias_correction=bias_correction, weighting=weighting,
        )  # fmt: skip
        super().__init__(rule, **kwargs)
        self.eta_l = eta_l


class FedYogi(RuleStrategy):
    """FedYogi: ``v ← v − (1−β2)·Δ̄²·sign(v − Δ̄²)``.

    Parameters
    ----------
    eta : float (default: 1e-2)
        Server learning rate.
    eta_l : float (default: 0.0316)
        Client learning rate (kept as ``self.eta_l``, not sent; as Flower).
    beta_1, beta_2 : float (default: 0.9, 0.99)
        Moment decay rates in [0, 1).
    tau : float (default: 1e-3)
        Adaptivity, added to √v.
    weighting : str (default: "num_examples")
        ``"uniform"`` for the paper.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        eta: float = 1e-2,
        eta_l: float = 0.0316,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        weighting: str = "num_examples",
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        rule = FedYogiRule(
            eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau, weighting=weighting
        )
        super().__init__(rule, **kwargs)
        self.eta_l = eta_l
