"""FedDuA: doubly adaptive server step (FedDuAdagrad, FedDuAdam): rule and declaration.

Paper: Takakura, Liew and Hasegawa, "FedDuA: Doubly Adaptive Federated
Learning" ("DUA" below; the paper text gives no arXiv id), Algorithm 1
lines 9-17 and eq. (3); §2 for FedAdagrad/FedAdam, whose s_t and v_t it
reuses. Per round, with Δ̄ = Σω_iΔ_i and A = Σω_i‖Δ_i‖²:

    ============  ==========================  =================================
                  FedDuAdagrad                FedDuAdam
    ============  ==========================  =================================
    s_t           s_{t−1} + Δ̄²                β2·s_{t−1} + (1−β2)·Δ̄²
    v_t           Δ̄                           β1·v_{t−1} + (1−β1)·Δ̄
    m_t           A/2                         (β1/2)·m_{t−1} + (1−β1)·A/2
    ============  ==========================  =================================

    G_t = diag(√s_t + ε),  q_t = ‖v_t‖²_{G_t^{-1}} = Σ v²/(√s+ε)
    η_t = m_t / (q_t + ε_g),  w_{t+1} = w_t + η_t·G_t^{-1}·v_t

Notes (decisions where the paper is ambiguous, with the reason):

* Norm in η_t. DUA Alg. 1 line 16 and §3 (the text after eq. (3)) print
  ``‖v‖²_{G}``, i.e. Σ v²(√s+ε) with ‖x‖_G = √(xᵀGx) (§1.1, Notation). We
  read it as a typo for ``‖v‖²_{G^{-1}}``: with ψ_t(x) = ½xᵀG_t x the dual
  is φ_t(θ) = ½θᵀG_t^{-1}θ, so the h_t of §3 (Thms 3.2, 3.3) is
  h_t(η) = η·vᵀG_t^{-1}v and h_t^{-1}(m_t) = m_t/‖v_t‖²_{G^{-1}};
  the paper's own App. F and App. G.2 (proof of Cor. G.4) write
  ‖Δ̄‖²_{G_t^{-1}}; and only G^{-1} keeps the step 1-homogeneous (scaling
  every Δ_i by c scales the step by c, as in FedAvg; with G it would scale
  by 1/c). With G ≡ I both read the same, so FedExP cannot tell them apart.
* No bias correction and no max(1,·) (DUA Alg. 1 lines 12-17 have neither;
  §5.2 calls the method hyperparameter-free). The β1/2 factor in m_t (line
  14) is intentional, not a typo for β1: it is the momentum lower bound of
  Thm 3.3 (proof in App. B), so m_t is not an exponential moving average.
* 0/0 := 0. With ε = 0 (allowed: DUA §5.2 reports that ε = 0 works)
  G_t = diag(√s_t + ε) of line 15 has zero entries where s_k = 0; there
  v_k = 0 too unless β2 = 0 (s_k = 0 means every Δ̄_k so far was 0). We
  define that ratio as 0, the limit of 0/(0 + ε) as ε → 0, so the
  coordinate does not move (also, rather than ∞, when β2 = 0 and v_k ≠ 0).
  Likewise q + ε_g = 0 (all-zero updates, ε_g = 0) in line 16 gives η = 0:
  no move, never NaN.
* ``preconditioner="identity"`` (G ≡ I, s ignored) turns FedDuAdagrad into
  FedExP without max(1,·), as DUA §2 restates FedExP, and FedDuAdam into
  FedExPM, which DUA §5.1 uses as a baseline without defining it; see
  :mod:`fedadapt.strategies.fedexp` for why we define it so.

The server computes each client's ‖Δ_i‖² itself and checks a reported
``update-sq-norm`` against it; ``secure_aggregation=True`` uses the reports
as given (see :class:`~fedadapt.strategies.adapter.RuleHost`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedadapt._validation import check_choice, check_decay_rate, check_scalar
from fedadapt.strategies.core.base import (
    Arrays,
    RoundStatistics,
    ServerRule,
    is_batchnorm_buffer,
    zeros_like,
)
from fedadapt.strategies.declaration import (
    AVERAGE_LAST_TWO,
    Algorithm,
    Paper,
    Param,
    message_class,
    weighting,
)

#: the FedDuA paper (DUA), which also runs FedExPM as a baseline
DUA = Paper(
    "FedDuA (DUA)",
    "Takakura, Liew, Hasegawa, *FedDuA: Doubly Adaptive Federated Learning* "
    "(Algorithm 1, eq. 3)",
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
        Decay rates in [0, 1) (FedDuAdam only; DUA §5.1 fixes 0.9, 0.99).
    epsilon : float (default: 1e-9)
        ε ≥ 0 in G = diag(√s + ε) (DUA §5.1 and App. H.3: 1e-9).
    epsilon_g : float (default: 0.0)
        ε_g ≥ 0 in the step-size denominator (DUA §5.2: 0 works).
    preconditioner : str (default: "diagonal")
        ``"identity"`` sets G ≡ I (FedExP / FedExPM).
    weighting : str (default: "uniform")
        The paper's uniform mean; ``"num_examples"`` weights Δ̄ and A alike.
    plain_average : Callable[[str], bool] | None (default: BatchNorm buffers)
        Keys plainly averaged and excluded from Δ̄, A and the preconditioner.
        BatchNorm buffers are running statistics, not parameters that DUA
        Alg. 1 lines 9-17 update, so an adaptive step on them is
        meaningless; the FedExP code (arXiv:2301.09604) likewise moves only
        ``parameters()``.
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
        self.beta_1 = check_decay_rate("beta_1", beta_1)
        self.beta_2 = check_decay_rate("beta_2", beta_2)
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
        guard = self.guard_step_size(stats)  # before v, s, m move
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
        denominator = q + self.step_epsilon(stats)
        eta = self.m / denominator if denominator > 0 else 0.0
        diagnostics = {"server-lr": eta, "q": q, "m": self.m}
        if guard is not None and guard < eta:
            diagnostics["server-lr-unguarded"] = eta
            eta = diagnostics["server-lr"] = guard
        new = {
            k: x + np.multiply(direction[k], eta, out=self.scratch(direction[k]))
            for k, x in current.items()
        }
        return new, diagnostics

    @property
    def robust_aggregation(self) -> str:
        """FedDuAdagrad: centered clipping; FedDuAdam: the mean.

        See :attr:`ServerRule.robust_aggregation`. FedDuAdagrad on
        digits-mlp, 5 seeds: honest 93.7 → 93.2 %, worst attack 4.8 → 0.8
        points; mnist5k-cnn 94.5 → 96.2 %, 4.4 → 1.0 (with the step guard
        over centered clipping, stop 62; mnist5k-cnn's five costliest
        attacks). FedDuAdam loses 1.6
        to 2.8 honest points with either robust aggregator and its worst
        attack stays above 2 (docs/robustness.md), so it keeps the mean.
        """
        if self.variant == "adagrad" and self.preconditioner == "diagonal":
            return "centered_clipping"
        return "mean"

    def guard_step_size(self, stats: RoundStatistics) -> float | None:
        """Return min_i η_t^{(−i)}: the step size were any one client absent.

        The step guard (issue #38, our addition; not in DUA): η_t adapts to
        the clients' disagreement, so one client that cancels part of Δ̄
        (a sign flip) or adds a direction of its own raises η_t and the
        server multiplies its push. Capping η_t at the smallest step size
        the round would give without each client in turn
        (``stats.without_each``, :func:`~fedadapt.strategies.core.
        aggregation.leave_one_out`) means no single client can raise the
        server's step size; its push moves the model by no more than the
        other clients' own step would. With the guard, A (in m) is the
        largest leave-one-out A, so that no single client can lower the
        step through A either (a short update:
        :func:`~fedadapt.strategies.core.aggregation.guarded_sq_norms`).
        Evaluated from the moments before this round's update (v, s, m are
        not touched). None when the guard is off.
        """
        self.leave_one_out_steps = None
        if stats.without_each is None:
            return None
        identity = self.preconditioner == "identity"
        adagrad, b1, b2 = self.variant == "adagrad", self.beta_1, self.beta_2
        eps_g = self.step_epsilon(stats)
        self.leave_one_out_steps = steps = []
        for delta, a in stats.without_each():
            if a is None:
                self.leave_one_out_steps = None
                return None
            if adagrad:
                m = 0.5 * a
                v = delta
            else:
                m = 0.5 * b1 * self.m + (1 - b1) * 0.5 * a
                v = {
                    k: (1 - b1) * d if self.v is None else b1 * self.v[k] + (1 - b1) * d
                    for k, d in delta.items()
                }
            q = 0.0
            for k, vk in v.items():
                if identity:
                    q += float(np.vdot(vk, vk))
                    continue
                square = np.square(delta[k])
                if adagrad:
                    s = square if self.s is None else self.s[k] + square
                else:
                    s = (
                        (1 - b2) * square
                        if self.s is None
                        else b2 * self.s[k] + (1 - b2) * square
                    )
                g = np.sqrt(s) + self.epsilon
                q += float(
                    np.sum(np.divide(vk * vk, g, out=np.zeros_like(g), where=g > 0))
                )
            denominator = q + eps_g
            steps.append(m / denominator if denominator > 0 else 0.0)
        return min(steps) if steps else None

    def step_epsilon(self, stats: RoundStatistics) -> float:
        """Return the ε_g of this update (FedExPM uses FedExP's decayed ε)."""
        return self.epsilon_g

    def _precondition(self, v: Arrays, s: Arrays) -> Arrays:
        """Return G^{-1}v = v/(√s + ε), with 0/0 := 0 (DUA Alg. 1 line 15).

        Where ε = 0 and s_k = 0 (then v_k = 0 unless β2 = 0) the ratio is
        taken as 0, the ε → 0 limit of 0/ε, so that coordinate does not move
        (see the module docstring).

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


FEDDUA = Algorithm(
    name="feddua",
    title="FedDuA",
    paper=DUA,
    server_step="η = m / (‖v‖²_{G⁻¹} + ε_g), preconditioned (`feddua.variant` adam or "
    "adagrad)",
    summary='FedDuAdam (``variant="adam"``) or FedDuAdagrad (``variant="adagrad"``).',
    notes="""There is no server learning rate: the step size η_t = m_t/(‖v_t‖²_{G⁻¹}
    + ε_g) adapts every round (DUA Algorithm 1, eq. (3)).""",
    rule=FedDuARule,
    params=(
        Param(
            "variant",
            "adam",
            "FedDuAdam or FedDuAdagrad.",
            "DUA §5.1 (FedDuAdam, the paper's main method)",
            choices=VARIANTS,
        ),
        Param(
            "beta_1",
            0.9,
            "Decay rate β1 of v and m (adam variant).",
            "DUA §5.1",
            low=0.0,
            high=1.0,
            high_open=True,
        ),
        Param(
            "beta_2",
            0.99,
            "Decay rate β2 of s (adam variant).",
            "DUA §5.1",
            low=0.0,
            high=1.0,
            high_open=True,
        ),
        Param(
            "epsilon",
            1e-9,
            "ε in the preconditioner G = diag(√s + ε).",
            "DUA §5.1 and App. H.3",
            low=0.0,
        ),
        Param(
            "epsilon_g",
            0.0,
            "ε_g in the step-size denominator.",
            "DUA §5.2 (0 works)",
            low=0.0,
        ),
        Param(
            "preconditioner",
            "diagonal",
            "G = diag(√s + ε), or identity (G ≡ I: FedExP without max(1,·) / FedExPM).",
            "DUA Algorithm 1",
            choices=PRECONDITIONERS,
        ),
        weighting("uniform", "DUA Algorithm 1 lines 9 and 12"),
        AVERAGE_LAST_TWO,
    ),
    adapter=frozenset({"average_last_two"}),
)

FedDuA = message_class(FEDDUA, __name__)
