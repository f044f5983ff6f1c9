"""FedExP / FedExPM: extrapolated server step [Jhunjhunwala et al., ICLR 2023].

Paper: arXiv:2301.09604 (Algorithm 1, the FedExP server step size). The
original rule (default):

    η_t = max{1, Σ_i ω_i‖Δ_i‖² / (2(‖Δ̄‖² + ε))},   x_{t+1} = x_t + η_t·Δ̄

``form="dua"`` is the restatement in FedDuA §2 (Takakura et al., "FedDuA:
Doubly Adaptive Federated Learning"; "DUA" below), which drops max(1,·).

ε: the paper adds ε to ‖Δ̄‖²; the authors' official code
(github.com/Divyansh03/FedExP, ``main.py``) instead adds |S_t|·ε and decays
ε by 0.998² per round, alongside the 0.998 decay of the client learning
rate. We follow the paper's formula by default (``eps_form="paper"``,
``eps_decay=1``), since the algorithm is defined by the paper; the code's
behaviours are options (``eps_form="times_S"``, ``eps_decay=0.998**2``) to
reproduce the code's numbers (its ε = 1e-3 with |S_t| = 20 equals
ε = 0.02 here).

``server_momentum = β > 0`` gives FedExPM. DUA uses it as a baseline
(§5.1, Table 2, Table 6) but never defines it. We define it as FedDuAdam
(DUA Algorithm 1 line 14) with G ≡ I, and so without max(1,·):
``v ← βv + (1−β)Δ̄``, ``m ← (β/2)m + (1−β)A/2``, ``η = m/(‖v‖² + ε)``,
``x ← x + η·v``. Reason: it is the G = I case of DUA's own momentum rule,
whose step-size bound (DUA Thm 3.3) has no max(1,·); and with ε = 0 it
gives the same step as the momentum variant in the FedExP code (heavy-ball
sums v = Δ̄ + 0.9v, m = A/2 + 0.45m, no max), because η·v does not change
when v and m are rescaled together. It reuses :class:`FedDuARule` rather
than repeating it.

The server computes each client's ‖x_i − x_t‖² from the arrays and checks
any reported ``update-sq-norm`` against it; only
``secure_aggregation=True`` uses the reports as given (see
:class:`~fedadapt.strategies.adapter.RuleHost`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fedadapt._validation import check_choice, check_decay_rate, check_scalar
from fedadapt.strategies.core.base import (
    Arrays,
    RoundStatistics,
    is_batchnorm_buffer,
    sq_norm,
)
from fedadapt.strategies.declaration import (
    AVERAGE_LAST_TWO,
    Algorithm,
    Paper,
    Param,
    message_class,
    weighting,
)
from fedadapt.strategies.feddua import DUA, FedDuARule

FORMS = ("original", "dua")
EPS_FORMS = ("paper", "times_S")


class FedExPRule(FedDuARule):
    """FedExP / FedExPM.

    A :class:`FedDuARule` with G ≡ I whose momentum step (FedExPM,
    ``server_momentum > 0``) is FedDuAdam's with β1 = ``server_momentum``
    and ε_g = this round's FedExP ε (:meth:`step_epsilon`); without
    momentum its own FedExP step. ``epsilon`` is FedExP's ε (FedDuA's
    preconditioner ε is unused under G ≡ I).

    Parameters
    ----------
    epsilon : float (default: 1e-3)
        ε ≥ 0 in the denominator.
    server_momentum : float (default: 0.0)
        β in [0, 1); > 0 selects FedExPM.
    form : str (default: "original")
        ``"original"`` (with max(1,·)) or ``"dua"`` (without).
    eps_form : str (default: "paper")
        ``"paper"`` or ``"times_S"`` (ε·|S_t|, the official code).
    eps_decay : float (default: 1.0)
        ε_t = ε·eps_decay^t, in (0, 1].
    weighting : str (default: "uniform")
        The paper's uniform mean; ``"num_examples"`` as the official code.
    plain_average : Callable[[str], bool] | None (default: BatchNorm buffers)
        See :class:`ServerRule`.
    """

    needs_sq_norms = True

    def __init__(
        self,
        *,
        epsilon: float = 1e-3,
        server_momentum: float = 0.0,
        form: str = "original",
        eps_form: str = "paper",
        eps_decay: float = 1.0,
        weighting: str = "uniform",
        plain_average: Callable[[str], bool] | None = is_batchnorm_buffer,
    ) -> None:
        momentum = check_decay_rate("server_momentum", server_momentum)
        super().__init__(
            variant="adam",
            beta_1=momentum,
            preconditioner="identity",
            weighting=weighting,
            plain_average=plain_average,
        )
        self.epsilon = check_scalar("epsilon", epsilon, low=0)
        self.server_momentum = momentum
        self.form = check_choice("form", form, FORMS)
        self.eps_form = check_choice("eps_form", eps_form, EPS_FORMS)
        self.eps_decay = check_scalar(
            "eps_decay", eps_decay, low=0, high=1, low_inclusive=False
        )

    @property
    def robust_aggregation(self) -> str:
        """FedExP: centered clipping; FedExPM: the mean.

        See :attr:`ServerRule.robust_aggregation`. FedExP on digits-mlp, 5
        seeds: honest 92.8 → 92.6 %, worst attack 4.4 → 1.4 points;
        mnist5k-cnn 93.7 → 96.1 %, 4.7 → 1.1 (with the step guard over
        centered clipping, stop 62; mnist5k-cnn's five costliest attacks).
        FedExPM loses 5 honest points with either robust aggregator
        (docs/robustness.md), so it keeps the mean.
        """
        return "centered_clipping" if self.server_momentum == 0 else "mean"

    def current_epsilon(self, num_clients: int) -> float:
        """Return ε for this update (decayed, times |S_t| in code form)."""
        eps = self.epsilon * self.eps_decay**self.num_updates
        return eps * num_clients if self.eps_form == "times_S" else eps

    def update(
        self, current: Arrays, stats: RoundStatistics
    ) -> tuple[Arrays, dict[str, float]]:
        """Apply one FedExP (or FedExPM) step."""
        if self.server_momentum > 0:
            return super().update(current, stats)
        eps = self.current_epsilon(stats.num_clients)
        denominator = 2.0 * (sq_norm(stats.mean_update) + eps)
        assert stats.mean_sq_norm is not None, "FedExP's step needs A"
        raw = float(stats.mean_sq_norm) / denominator if denominator > 0 else 0.0
        diagnostics = {"epsilon": eps}
        guard = self.guard_raw_step(stats, eps)
        if guard is not None and guard < raw:
            diagnostics["server-lr-unguarded"] = (
                max(1.0, raw) if self.form == "original" else raw
            )
            raw = guard
        eta = max(1.0, raw) if self.form == "original" else raw
        new = {k: x + eta * stats.mean_update[k] for k, x in current.items()}
        return new, {"server-lr": eta, **diagnostics}

    def guard_raw_step(self, stats: RoundStatistics, eps: float) -> float | None:
        """Return min_i A_{−i} / (2(‖Δ̄_{−i}‖² + ε)): the step guard.

        See :meth:`FedDuARule.guard_step_size` (the same guard, our
        addition): no single client can raise FedExP's extrapolation; the
        max(1,·) floor still applies after it. None when the guard is off.
        """
        self.leave_one_out_steps = None
        if stats.without_each is None:
            return None
        raw = []
        for delta, a in stats.without_each():
            if a is None:
                return None
            denominator = 2.0 * (sq_norm(delta) + eps)
            raw.append(a / denominator if denominator > 0 else 0.0)
        floor = 1.0 if self.form == "original" else 0.0
        self.leave_one_out_steps = [max(floor, r) for r in raw]
        return min(raw) if raw else None

    def step_epsilon(self, stats: RoundStatistics) -> float:
        """Return FedExPM's ε_g: this round's FedExP ε."""
        return self.current_epsilon(stats.num_clients)

    def _state(self) -> dict[str, Any]:
        # the format of the nested FedDuA rule of earlier versions
        return {"momentum": super()._state() if self.server_momentum > 0 else None}

    def _load(self, state: Mapping[str, Any]) -> None:
        if self.server_momentum > 0:
            momentum = dict(state["momentum"])
            momentum.pop("num_updates", None)  # earlier versions' nested rule
            super()._load(momentum)


_EPSILON = Param(
    "epsilon",
    1e-3,
    "ε in the denominator 2(‖Δ̄‖² + ε).",
    "FedExP's experiments and official code",
    low=0.0,
)
_EPS_FORM = Param(
    "eps_form",
    "paper",
    "paper: ε as in the formula; times_S: ε·|S_t|, as the official code.",
    "FedExP Algorithm 1",
    choices=EPS_FORMS,
)
_EPS_DECAY = Param(
    "eps_decay",
    1.0,
    "Per-round decay of ε: ε_t = ε·eps_decay^t (the official code: 0.998**2).",
    "FedExP Algorithm 1 (no decay)",
    low=0.0,
    high=1.0,
    low_open=True,
)
_UNIFORM = "FedExP Algorithm 1 (uniform mean)"

FEDEXP = Algorithm(
    name="fedexp",
    title="FedExP",
    paper=Paper(
        "Jhunjhunwala et al. 2023",
        "Jhunjhunwala, Wang, Joshi, *FedExP: Speeding Up Federated Averaging via "
        "Extrapolation*, ICLR 2023",
    ),
    server_step="η = max(1, mean‖Δ_i‖² / (2(‖Δ̄‖² + ε)))",
    summary="FedExP, or FedExPM with ``server_momentum > 0``.",
    rule=FedExPRule,
    params=(
        _EPSILON,
        Param(
            "server_momentum",
            0.0,
            "β; > 0 gives FedExPM (see strategy fedexpm).",
            "FedExP (no momentum)",
            low=0.0,
            high=1.0,
            high_open=True,
        ),
        Param(
            "form",
            "original",
            "original (with max(1,·)) or dua (FedDuA §2, without).",
            "FedExP Algorithm 1",
            choices=FORMS,
        ),
        _EPS_FORM,
        _EPS_DECAY,
        weighting("uniform", _UNIFORM),
        AVERAGE_LAST_TWO,
    ),
    adapter=frozenset({"average_last_two"}),
)
FEDEXPM = Algorithm(
    name="fedexpm",
    title="FedExPM",
    paper=DUA,
    server_step="FedExP's step with momentum: FedDuAdam with G = I (DUA's baseline)",
    summary="FedExPM: FedDuAdam with G ≡ I (FedDuA's momentum baseline, §5.1).",
    rule=FedExPRule,
    params=(
        _EPSILON,
        Param(
            "server_momentum",
            0.9,
            "Momentum β of v and m.",
            "DUA §5.1 (the β1 it fixes for its momentum methods)",
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
        ),
        _EPS_FORM,
        _EPS_DECAY,
        weighting("uniform", _UNIFORM),
        AVERAGE_LAST_TWO,
    ),
    adapter=frozenset({"average_last_two"}),
)

FedExP = message_class(FEDEXP, __name__)
FedExPM = message_class(FEDEXPM, __name__)
