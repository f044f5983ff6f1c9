"""FedDuA: doubly adaptive federated learning (FedDuAdagrad, FedDuAdam).

Paper: "FedDuA: Doubly Adaptive Federated Learning" (Takakura), Algorithm 1
and eq. (3). The rule is :class:`fedadapt.strategies.core.FedDuARule`; this
class only builds it. The server computes each client's ‖Δ_i‖² itself and
checks a reported ``update-sq-norm`` against it; ``secure_aggregation=True``
uses the reports as given (see :class:`~fedadapt.strategies.adapter.RuleHost`).
"""

from __future__ import annotations

from typing import Unpack

from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies.core import FedDuARule


class FedDuA(RuleStrategy):
    """FedDuAdam (``variant="adam"``) or FedDuAdagrad (``variant="adagrad"``).

    There is no server learning rate: the step size η_t = m_t/(‖v_t‖²_{G⁻¹}
    + ε_g) adapts every round.

    Parameters
    ----------
    variant : str (default: "adam")
        ``"adam"`` or ``"adagrad"``.
    beta_1, beta_2 : float (default: 0.9, 0.99)
        Decay rates in [0, 1) (FedDuAdam).
    epsilon : float (default: 1e-9)
        ε ≥ 0 in the preconditioner diag(√s + ε).
    epsilon_g : float (default: 0.0)
        ε_g ≥ 0 in the step-size denominator.
    weighting : str (default: "uniform")
        The paper's mean; ``"num_examples"`` weights Δ̄ and A alike.
    average_last_two : bool (default: True)
        Evaluate (w_t + w_{t+1})/2 "as in FedExP" (FedDuA §5.1): the round's
        returned model; training continues from w_{t+1}.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        variant: str = "adam",
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        epsilon: float = 1e-9,
        epsilon_g: float = 0.0,
        weighting: str = "uniform",
        average_last_two: bool = True,
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        rule = FedDuARule(
            variant=variant, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            epsilon_g=epsilon_g, weighting=weighting,
        )  # fmt: skip
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
