"""FedDuA: doubly adaptive server step (FedDuAdagrad, FedDuAdam).

Paper: "FedDuA: Doubly Adaptive Federated Learning" (shared/papers/feddua.txt),
Algorithm 1 lines 9-17 and eq. (3); spec §4. Per round, with
Δ̄ = Σω_iΔ_i and A = Σω_i‖Δ_i‖²:

    ============  ==========================  =================================
                  FedDuAdagrad                FedDuAdam
    ============  ==========================  =================================
    s_t           s_{t−1} + Δ̄²                β2·s_{t−1} + (1−β2)·Δ̄²
    v_t           Δ̄                           β1·v_{t−1} + (1−β1)·Δ̄
    m_t           A/2                         (β1/2)·m_{t−1} + (1−β1)·A/2
    ============  ==========================  =================================

    G_t = diag(√s_t + ε),  q_t = ‖v_t‖²_{G_t^{-1}} = Σ v²/(√s+ε)
    η_t = m_t / (q_t + ε_g),  w_{t+1} = w_t + η_t·G_t^{-1}·v_t

Notes (spec §4.1-4.4, A-F1, A-F16-A-F18):

* The paper prints ``‖v‖²_{G}``; that is a typo for ``‖v‖²_{G^{-1}}`` (the
  derivation, App. F/G.2 and 1-homogeneity of the step all need G^{-1}).
* No bias correction, no max(1,·); the β1/2 factor in m_t is intentional.
* Where √s_k + ε = 0 (ε = 0 and s_k = 0, hence v_k = 0) the ratio is 0, and
  q + ε_g = 0 (all-zero updates) gives η = 0: no move, never NaN.
* ``preconditioner="identity"`` (G ≡ I) turns FedDuAdagrad into FedExP
  without max(1,·) and FedDuAdam into FedExPM (spec §4.4, §5.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedadapt._validation import check_choice, check_scalar
from fedadapt.strategies.core.base import (
    Arrays,
    RoundStatistics,
    ServerRule,
    is_batchnorm_buffer,
    zeros_like,
)

VARIANTS = ("adam", "adagrad")
PRECONDITIONERS = ("diagonal", "identity")


class FedDuARule(ServerRule):
    """FedDuAdagrad / FedDuAdam (DUA Alg. 1).

    Parameters
    ----------
    variant : str (default: "adam")
        ``"adam"`` (FedDuAdam) or ``"adagrad"`` (FedDuAdagrad).
    beta_1, beta_2 : float (default: 0.9, 0.99)
        Decay rates in [0, 1) (FedDuAdam only; DUA §5.1).
    epsilon : float (default: 1e-9)
        ε ≥ 0 in G = diag(√s + ε) (DUA §5.1: 1e-9 for images/NLP).
    epsilon_g : float (default: 0.0)
        ε_g ≥ 0 in the step-size denominator (DUA: 0 works).
    preconditioner : str (default: "diagonal")
        ``"identity"`` sets G ≡ I (FedExP / FedExPM).
    weighting : str (default: "uniform")
        The paper's uniform mean; ``"num_examples"`` weights Δ̄ and A alike.
    plain_average : Callable[[str], bool] | None (default: BatchNorm buffers)
        Keys averaged and excluded from norms and preconditioner (spec §1.3).
    """

    needs_sq_norms = True

    def __init__(
        self,
        *,
        variant: str = "adam",
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        epsilon: float = 1e-9,
        epsilon_g: float = 0.0,
        preconditioner: str = "diagonal",
        weighting: str = "uniform",
        plain_average: Callable[[str], bool] | None = is_batchnorm_buffer,
    ) -> None:
        super().__init__(weighting=weighting, plain_average=plain_average)
        self.variant = check_choice("variant", variant, VARIANTS)
        self.beta_1 = check_scalar(
            "beta_1", beta_1, low=0, high=1, high_inclusive=False
        )
        self.beta_2 = check_scalar(
            "beta_2", beta_2, low=0, high=1, high_inclusive=False
        )
        self.epsilon = check_scalar("epsilon", epsilon, low=0)
        self.epsilon_g = check_scalar("epsilon_g", epsilon_g, low=0)
        self.preconditioner = check_choice(
            "preconditioner", preconditioner, PRECONDITIONERS
        )
        self.s: Arrays | None = None
        self.v: Arrays | None = None
        self.m = 0.0
        self._direction: Arrays | None = None

    def update(
        self, current: Arrays, stats: RoundStatistics
    ) -> tuple[Arrays, dict[str, float]]:
        """Apply one FedDuA step (DUA Alg. 1 lines 12-17).

        v and s are updated in place and G^{-1}v is built in a buffer kept
        across rounds; per element the operations and their order are those
        of the formulas in the module docstring.
        """
        assert stats.mean_sq_norm is not None, "FedDuA's step needs A"
        delta, half_a = stats.mean_update, 0.5 * float(stats.mean_sq_norm)
        identity = self.preconditioner == "identity"
        if self.v is None:
            self.v = zeros_like(delta)
            self.s = None if identity else zeros_like(delta)
        if self.variant == "adagrad":
            for k, v in self.v.items():
                np.copyto(v, delta[k])
            self.m = half_a
        else:
            b1 = self.beta_1
            for k, v in self.v.items():
                v *= b1
                v += np.multiply(delta[k], 1 - b1, out=self.scratch(delta[k]))
            self.m = 0.5 * b1 * self.m + (1 - b1) * half_a
        if self.s is not None:
            adagrad, b2 = self.variant == "adagrad", self.beta_2
            for k, s in self.s.items():
                square = np.square(delta[k], out=self.scratch(delta[k]))
                if not adagrad:
                    s *= b2
                    square *= 1 - b2
                s += square
        direction = self.v if self.s is None else self._precondition(self.v, self.s)
        q = math.fsum(float(np.vdot(self.v[k], u)) for k, u in direction.items())
        denominator = q + self.epsilon_g
        eta = self.m / denominator if denominator > 0 else 0.0
        new = {
            k: x + np.multiply(direction[k], eta, out=self.scratch(direction[k]))
            for k, x in current.items()
        }
        return new, {"server-lr": eta, "q": q, "m": self.m}

    def _precondition(self, v: Arrays, s: Arrays) -> Arrays:
        """Return G^{-1}v = v/(√s + ε), with 0/0 := 0 (A-F18).

        Written into arrays kept between rounds (``self._direction``).
        """
        if self._direction is None:
            self._direction = {k: np.empty_like(vk) for k, vk in v.items()}
        for k, vk in v.items():
            g = np.sqrt(s[k], out=self.scratch(s[k]))
            g += self.epsilon
            out = self._direction[k]
            out.fill(0)
            np.divide(vk, g, out=out, where=g > 0)
        return self._direction

    def _state(self) -> dict[str, Any]:
        return {"s": self.s, "v": self.v, "m": self.m}

    def _load(self, state: Mapping[str, Any]) -> None:
        self.s, self.v, self.m = state["s"], state["v"], float(state["m"])
        self._direction = None
