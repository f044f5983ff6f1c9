"""Paper claims on FedDuA's synthetic linear regression (spec §10.2 C1-C3).

Setting (DUA §5.1, App. H.2/H.3; spec §7.3 and A-F5): the generator
:func:`fedadapt.tasks.synthetic.make_feddua_linreg` (M = 20 clients × 30
samples, d = 1000, Σ_kk = k^-1.1), training loss
F(w) = (1/M) Σ_i (1/(2n)) ‖X_i w − y_i‖², w_0 = 0, all 20 clients every round,
τ = 20 local full-batch GD steps (batch 50 ≥ 30 samples), uniform weights,
ε = ε_g = 0 (FedDuA), ε = 0 with max(1,·) (FedExP), τ_FedOpt = 0 ("we fix
ε = 0" for synthetic, App. H.3), no bias correction (FedAdam as in DUA §2),
float64. Grids (App. H.3): η_l ∈ {1e-3, …, 1e-1}; η_g ∈ {1e-1, …, 1e1} for
FedAvg and {1e-2, …, 1} for FedAdam/FedAdagrad; five points spaced 10^0.5.
FedExP and FedDuA have no η_g. The server rules are the framework-free ones in
:mod:`fedadapt.strategies.core`.

Evaluation (A-F13): FedExP and FedDuA are scored on the average of their last
two iterates, FedAvg/FedAdam/FedAdagrad on the last iterate; "best grid
point" means the lowest such loss at the round being compared.

Speed: local GD on a quadratic is linear, so τ steps have a closed form in
each client's row space (see :class:`_Federation`); the rules are driven
through ``apply`` with the round's sums Δ̄ and A (exactly ``step``'s result,
U20). :func:`test_closed_form_training_matches_explicit_gd_and_step` checks
both against explicit einsum GD steps and ``rule.step``. The whole grid
(90 runs × 500 rounds × 3 seeds) runs once per module, in seconds.

Numbers (this machine; losses at round 500, best grid point, seeds 0/1/2; the
trajectories of FedExP and FedDuAdagrad are chaotic, so their digits move by
up to ~10× with the BLAS build or thread count — the margins allow for it):
see the table in :func:`test_c1_feddua_beats_baselines_after_500_rounds`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from fedadapt.strategies.core import (
    FedAdagradRule,
    FedAdamRule,
    FedAvgRule,
    FedDuARule,
    FedExPRule,
    RoundStatistics,
    ServerRule,
)
from fedadapt.tasks.synthetic import linreg_grad, linreg_loss, make_feddua_linreg

LOCAL_STEPS = 20  # τ (DUA §5.1)
ROUNDS = 500  # DUA App. H.3 (synthetic); A-F10
SEEDS = (0, 1, 2)
ETA_L = tuple(10.0**e for e in (-3.0, -2.5, -2.0, -1.5, -1.0))
ETA_G_FEDAVG = tuple(10.0**e for e in (-1.0, -0.5, 0.0, 0.5, 1.0))
ETA_G_FEDOPT = tuple(10.0**e for e in (-2.0, -1.5, -1.0, -0.5, 0.0))
EPS_G = (0.0, 1e-3, 1e-2, 1e-1)  # C3 (DUA §5.2, Fig. 2)
AVERAGED = ("FedExP", "FedDuAdagrad", "FedDuAdam")  # A-F13
BASELINES = ("FedAvg", "FedExP", "FedAdagrad", "FedAdam")
DIVERGED = 1e4  # a run whose loss exceeds DIVERGED × F(w_0) is stopped


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """Run BLAS single-threaded: threaded gemms this small are ~15× slower."""
    try:
        from threadpoolctl import threadpool_limits  # via scikit-learn
    except ImportError:  # pragma: no cover - speed only
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


# --- the federation, with τ local GD steps in closed form -------------------------


class _Federation:
    """All M clients of one seed; one round of τ local GD steps in closed form.

    With X_i = U_i S_i V_iᵀ (thin SVD, rank n ≤ d), f_i's Hessian is
    V_i Λ_i V_iᵀ (Λ_i = S_i²/n) and ∇f_i(w) = V_i(Λ_i V_iᵀw − b_i) with
    b_i = S_i U_iᵀ y_i / n. GD moves only z = V_iᵀw, coordinate-wise
    z ← z − η_l(Λz − b), so after τ steps

        Δ_i = −V_i [φ ⊙ (Λ_i z_0 − b_i)],  φ = (1 − (1 − η_lΛ_i)^τ) / Λ_i,

    ‖Δ_i‖² = ‖φ ⊙ (Λ_i z_0 − b_i)‖² (orthonormal V_i), and, U_i being square
    and orthogonal, ‖X_i w − y_i‖² = ‖S_i z − U_iᵀy_i‖².
    """

    def __init__(self, seed: int, local_steps: int = LOCAL_STEPS) -> None:
        self.x, self.y = make_feddua_linreg(seed)
        m, n, d = self.x.shape
        self.num_clients, self.num_samples, self.dim = m, n, d
        self.local_steps = local_steps
        u, s, vt = np.linalg.svd(self.x, full_matrices=False)
        self.basis = vt.reshape(m * n, d)  # stacked V_iᵀ
        self.sing = s.reshape(-1)
        self.lam = self.sing**2 / n
        self.uty = np.einsum("mjk,mj->mk", u, self.y).reshape(-1)
        self.b = self.sing * self.uty / n

    def phi(self, eta_l: np.ndarray) -> np.ndarray:
        """Return φ for each run's η_l: shape (C, M·n)."""
        decay = (1.0 - np.asarray(eta_l)[:, None] * self.lam) ** self.local_steps
        return (1.0 - decay) / self.lam

    def coordinates(self, w: np.ndarray) -> np.ndarray:
        """Return z = (V_iᵀ w)_i for each row of w: shape (C, M·n)."""
        return w @ self.basis.T

    def loss(self, z: np.ndarray) -> np.ndarray:
        """Return F at the models with coordinates z: shape (C,)."""
        r = self.sing * z - self.uty
        return 0.5 * np.einsum("ck,ck->c", r, r) / (self.num_clients * self.num_samples)

    def round_statistics(
        self, z: np.ndarray, phi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return Δ̄ = (1/M)Σ_iΔ_i, shape (C, d), and A = (1/M)Σ_i‖Δ_i‖², (C,)."""
        coef = -phi * (self.lam * z - self.b)
        mean_update = (coef @ self.basis) / self.num_clients
        mean_sq_norm = np.einsum("ck,ck->c", coef, coef) / self.num_clients
        return mean_update, mean_sq_norm

    def explicit_deltas(self, w: np.ndarray, eta_l: float) -> np.ndarray:
        """Return every Δ_i, shape (M, d), from τ explicit full-batch GD steps."""
        local = np.tile(w, (self.num_clients, 1))
        for _ in range(self.local_steps):
            local -= eta_l * linreg_grad(local, self.x, self.y)
        return local - w


@dataclass
class _Run:
    method: str
    eta_l: float
    knob: float | None  # η_g (FedAvg, FedOpt) or ε_g (FedDuA); None for FedExP
    make: Callable[[], ServerRule]


@dataclass
class _Trace:
    """Losses of every run: ``last[t]`` = F(w_t), ``avg2[t]`` = F((w_t+w_{t−1})/2)."""

    runs: list[_Run]
    last: np.ndarray  # (rounds + 1, C); inf once diverged
    avg2: np.ndarray

    def evaluated(self, index: int) -> np.ndarray:
        """Return run ``index``'s loss curve as scored under A-F13."""
        trace = self.avg2 if self.runs[index].method in AVERAGED else self.last
        return trace[:, index]

    def best(self, method: str, at_round: int) -> tuple[float, _Run]:
        """Return (loss, run) of ``method``'s best grid point at ``at_round``."""
        pairs = [
            (float(self.evaluated(i)[at_round]), run)
            for i, run in enumerate(self.runs)
            if run.method == method
        ]
        return min(pairs, key=lambda p: p[0])

    def find(self, method: str, eta_l: float, knob: float | None) -> int:
        """Return the index of one run."""
        (index,) = [
            i
            for i, r in enumerate(self.runs)
            if r.method == method and r.eta_l == eta_l and r.knob == knob
        ]
        return index


def _simulate(fed: _Federation, runs: list[_Run], rounds: int = ROUNDS) -> _Trace:
    """Train every run for ``rounds`` rounds at once; return the loss traces."""
    rules = [run.make() for run in runs]
    num_runs = len(runs)
    w = np.zeros((num_runs, fed.dim))
    phi = fed.phi(np.array([run.eta_l for run in runs]))
    last = np.full((rounds + 1, num_runs), np.inf)
    avg2 = np.full((rounds + 1, num_runs), np.inf)
    alive = np.arange(num_runs)
    z_prev = fed.coordinates(w)
    limit = DIVERGED * float(fed.loss(z_prev[:1])[0])
    with _one_blas_thread(), np.errstate(over="ignore", invalid="ignore"):
        for t in range(rounds + 1):
            z = fed.coordinates(w[alive])
            last[t, alive] = fed.loss(z)
            avg2[t, alive] = fed.loss(0.5 * (z + z_prev[alive]))
            z_prev[alive] = z
            ok = np.isfinite(last[t, alive]) & (last[t, alive] < limit)
            last[t, alive[~ok]] = avg2[t, alive[~ok]] = np.inf
            alive, z = alive[ok], z[ok]
            if t == rounds or alive.size == 0:
                break
            mean_update, mean_sq_norm = fed.round_statistics(z, phi[alive])
            for j, c in enumerate(alive):
                stats = RoundStatistics(
                    {"w": mean_update[j]}, float(mean_sq_norm[j]), fed.num_clients
                )
                new, _ = rules[c].apply({"w": w[c]}, stats)
                w[c] = new["w"]
    return _Trace(runs, last, avg2)


# --- the grids --------------------------------------------------------------------


def _fedavg(eta_g: float) -> Callable[[], ServerRule]:
    return lambda: FedAvgRule(server_lr=eta_g, weighting="uniform")


def _fedadam(eta_g: float) -> Callable[[], ServerRule]:
    return lambda: FedAdamRule(
        eta=eta_g, tau=0.0, bias_correction="none", weighting="uniform"
    )


def _fedadagrad(eta_g: float) -> Callable[[], ServerRule]:
    return lambda: FedAdagradRule(eta=eta_g, tau=0.0, weighting="uniform")


def _fedexp() -> ServerRule:
    return FedExPRule(epsilon=0.0, form="original", weighting="uniform")


def _feddua(variant: str, eps_g: float) -> Callable[[], ServerRule]:
    return lambda: FedDuARule(
        variant=variant, epsilon=0.0, epsilon_g=eps_g, weighting="uniform"
    )


def _paper_grid() -> list[_Run]:
    """Return the App. H.3 synthetic grid: 90 runs."""
    runs = []
    for eta_l in ETA_L:
        runs += [_Run("FedAvg", eta_l, g, _fedavg(g)) for g in ETA_G_FEDAVG]
        runs += [_Run("FedAdam", eta_l, g, _fedadam(g)) for g in ETA_G_FEDOPT]
        runs += [_Run("FedAdagrad", eta_l, g, _fedadagrad(g)) for g in ETA_G_FEDOPT]
        runs.append(_Run("FedExP", eta_l, None, _fedexp))
        runs.append(_Run("FedDuAdagrad", eta_l, 0.0, _feddua("adagrad", 0.0)))
        runs.append(_Run("FedDuAdam", eta_l, 0.0, _feddua("adam", 0.0)))
    return runs


@pytest.fixture(scope="module")
def federations() -> dict[int, _Federation]:
    return {seed: _Federation(seed) for seed in SEEDS}


@pytest.fixture(scope="module")
def grid(federations: dict[int, _Federation]) -> dict[int, _Trace]:
    """The full App. H.3 grid, 500 rounds, for every seed (computed once)."""
    return {seed: _simulate(fed, _paper_grid()) for seed, fed in federations.items()}
