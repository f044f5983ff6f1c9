"""FedExP: extrapolated server step [Jhunjhunwala et al., ICLR 2023].

Paper: arXiv:2301.09604. The rule (its step size, with the paper's
equations) is :class:`fedadapt.strategies.core.FedExPRule`; this class only
builds it. The
server computes each client's ‖x_i − x_t‖² from the arrays and checks any
reported ``update-sq-norm`` against it; only ``secure_aggregation=True``
uses the reports as given (see
:class:`~fedadapt.strategies.adapter.RuleHost`).
"""

from __future__ import annotations

from typing import Unpack

from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies.core import FedExPRule


class FedExP(RuleStrategy):
    """FedExP, or FedExPM with ``server_momentum > 0``.

    Parameters
    ----------
    epsilon : float (default: 1e-3)
        ε ≥ 0 in η = max(1, A / (2(‖Δ̄‖² + ε))).
    server_momentum : float (default: 0.0)
        β in [0, 1); > 0 gives FedExPM, the momentum baseline of FedDuA §5.1,
        which names it without defining it; ours is FedDuAdam (Alg. 1) with
        G ≡ I and no max(1,·).
    form : str (default: "original")
        ``"original"`` (with max(1,·)) or ``"dua"`` (FedDuA §2, without).
    eps_form : str (default: "paper")
        ``"times_S"`` multiplies ε by the participants, as the official code.
    eps_decay : float (default: 1.0)
        Per-round decay of ε (the official code: 0.998**2).
    weighting : str (default: "uniform")
        The paper's mean; ``"num_examples"`` weights Δ̄ and A alike.
    average_last_two : bool (default: True)
        Evaluate (w_t + w_{t+1})/2, as the paper: the round's returned model;
        training continues from w_{t+1}.
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        epsilon: float = 1e-3,
        server_momentum: float = 0.0,
        form: str = "original",
        eps_form: str = "paper",
        eps_decay: float = 1.0,
        weighting: str = "uniform",
        average_last_two: bool = True,
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        rule = FedExPRule(
            epsilon=epsilon, server_momentum=server_momentum, form=form,
            eps_form=eps_form, eps_decay=eps_decay, weighting=weighting,
        )  # fmt: skip
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
