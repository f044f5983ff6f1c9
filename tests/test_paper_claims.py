"""Paper claims C1-C3 on FedDuA's synthetic linear regression.

The claims (our labels):

* C1: at each method's best grid point, FedDuAdagrad and FedDuAdam reach a
  lower training loss than FedAvg, FedExP, FedAdagrad and FedAdam (DUA §5.2,
  "FedDuA consistently outperforms baselines", Fig. 1).
* C2: FedExP reaches a given loss in fewer rounds than FedAvg with η_g = 1
  (the headline of FedExP, arXiv:2301.09604; DUA only implies it).
* C3: FedDuA is less sensitive to ε_g than FedAdam is to η_g (DUA §5.2,
  "robust to the choice of hyperparameters", Fig. 2).

Setting (DUA §5.1, App. H.2/H.3). Where App. H.2 leaves the generator open,
our reading: one model w_{i,j} per sample as written, N(0, 0.1) as a scalar
w_i with standard deviation 0.1, no normalisation, and the loss below. The
generator
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

Evaluation: FedExP and FedDuA are scored on the average of their last two
iterates, FedAvg/FedAdam/FedAdagrad on the last iterate (our choice: DUA §5.1
adopts FedExP's last-two averaging without saying for which methods); "best
grid point" means the lowest such loss at the round being compared.

Speed: local GD on a quadratic is linear, so τ steps have a closed form in
each client's row space (see :class:`_Federation`); the rules are driven
through ``apply`` with the round's sums Δ̄ and A (exactly ``step``'s result,
as tests/strategies/test_rules.py checks).
:func:`test_closed_form_training_matches_explicit_gd_and_step` checks
both against explicit einsum GD steps and ``rule.step``. The whole grid
(90 runs × 500 rounds × 3 seeds) runs once per module, in seconds.

Outcome (numbers in each test's docstring; seeds 0/1/2, checked on 3-5 too):

* C1 (500 rounds) holds for FedDuAdagrad, ≥ 3 decades below every baseline,
  and for FedDuAdam against FedAvg and FedExP (≥ 8 decades). FedDuAdam beats
  FedAdam only on average over seeds (FedAdam's final loss is erratic), and
  does not beat FedAdagrad: strict xfail. At round 100 FedAdam is ahead of
  both FedDuA variants: strict xfail.
* C2 holds: FedExP needs 7-26× fewer rounds than FedAvg (η_g = 1).
* C3 holds under the paper's 50-round protocol (Fig. 2), not after 500 rounds.
"""

from __future__ import annotations

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
from fedadapt.strategies.core.aggregation import apply_statistics
from fedadapt.tasks.synthetic import linreg_grad, linreg_loss, make_feddua_linreg

LOCAL_STEPS = 20  # τ (DUA §5.1)
ROUNDS = 500  # DUA App. H.3 (synthetic)
SEEDS = (0, 1, 2)
ETA_L = tuple(10.0**e for e in (-3.0, -2.5, -2.0, -1.5, -1.0))
ETA_G_FEDAVG = tuple(10.0**e for e in (-1.0, -0.5, 0.0, 0.5, 1.0))
ETA_G_FEDOPT = tuple(10.0**e for e in (-2.0, -1.5, -1.0, -0.5, 0.0))
EPS_G = (0.0, 1e-3, 1e-2, 1e-1)  # C3 (DUA §5.2, Fig. 2)
AVERAGED = ("FedExP", "FedDuAdagrad", "FedDuAdam")  # last-two average (docstring)
BASELINES = ("FedAvg", "FedExP", "FedAdagrad", "FedAdam")
DIVERGED = 1e4  # a run whose loss exceeds DIVERGED × F(w_0) is stopped


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    """Run BLAS/LAPACK single-threaded: threaded calls this small are far slower.

    (Measured: a 90×1000×600 gemm takes 2 ms on one thread, 30 ms on two busy
    cores.) threadpoolctl comes with scikit-learn; without it, only speed
    suffers.
    """
    try:
        from threadpoolctl import threadpool_limits
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
        """Return run ``index``'s loss curve as scored (module docstring)."""
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
    with np.errstate(over="ignore", invalid="ignore"):
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
                new, _ = apply_statistics(rules[c], {"w": w[c]}, stats)
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


def _span_log10(values: list[float]) -> float:
    return math.log10(max(values) / min(values))


# --- the generator ----------------------------------------------------------------


def test_generator_follows_spec_c1():
    """DUA App. H.2 generator, as we read it: shapes, RNG order, determinism."""
    x, y = make_feddua_linreg(seed=3)
    assert x.shape == (20, 30, 1000) and y.shape == (20, 30)
    assert x.dtype == y.dtype == np.float64
    # Independent transcription of that reading: same draws, same order.
    rng = np.random.default_rng(3)
    sd = np.arange(1, 1001) ** (-1.1 / 2)
    for i in range(20):
        w_i = rng.normal(0.0, 0.1)
        x_i = rng.normal(size=(30, 1000)) * sd
        w_ij = rng.normal(w_i, 1.0, size=(30, 1000))
        np.testing.assert_array_equal(x[i], x_i)
        np.testing.assert_array_equal(y[i], np.einsum("jk,jk->j", x_i, w_ij))
    again, y_again = make_feddua_linreg(seed=3)
    np.testing.assert_array_equal(again, x)
    np.testing.assert_array_equal(y_again, y)
    other, _ = make_feddua_linreg(seed=4)
    assert not np.array_equal(other, x)
    small, y_small = make_feddua_linreg(
        seed=0, dim=7, num_clients=3, samples_per_client=5
    )
    assert small.shape == (3, 5, 7) and y_small.shape == (3, 5)
    with pytest.raises(ValueError, match="num_clients"):
        make_feddua_linreg(num_clients=0)


def test_generator_covariance_decays_as_k_to_the_minus_1_1():
    """DUA §5.1 / App. H.2: x ~ N(0, Σ), Σ_kk = k^-1.1 (empirical, 600 samples)."""
    x, _ = make_feddua_linreg(seed=0)
    var = x.reshape(-1, x.shape[-1]).var(axis=0)
    k = np.arange(1, x.shape[-1] + 1)
    ratio = var / k**-1.1  # each ≈ 1 ± 0.06 (χ²_600 / 600)
    assert 0.6 < ratio.min() and ratio.max() < 1.5
    assert abs(np.mean(ratio) - 1.0) < 0.02
    slope = np.polyfit(np.log(k), np.log(var), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.03)


def test_loss_and_gradient_match_their_definitions():
    """Our reading of DUA's regression loss.

    F(w) = (1/M)Σ_i (1/(2n))‖X_i w − y_i‖²; ∇f_i = X_iᵀ(X_i w − y_i)/n.
    """
    x, y = make_feddua_linreg(seed=1, dim=50, num_clients=4, samples_per_client=6)
    w = np.random.default_rng(0).normal(size=50)
    expected = np.mean([np.sum((x[i] @ w - y[i]) ** 2) / (2 * 6) for i in range(4)])
    assert linreg_loss(w, x, y) == pytest.approx(expected, rel=1e-12)
    grads = linreg_grad(w, x, y)
    for i in range(4):
        np.testing.assert_allclose(grads[i], x[i].T @ (x[i] @ w - y[i]) / 6)
    # one model per client, and the mean gradient is ∇F (central differences)
    per_client = np.stack([w + i for i in range(4)])
    np.testing.assert_allclose(
        linreg_grad(per_client, x, y)[2], x[2].T @ (x[2] @ (w + 2) - y[2]) / 6
    )
    e = np.zeros(50)
    e[7] = 1e-6
    numeric = (linreg_loss(w + e, x, y) - linreg_loss(w - e, x, y)) / 2e-6
    assert numeric == pytest.approx(grads.mean(axis=0)[7], rel=1e-6)


def test_problem_interpolates():
    """DUA §5.1 sizes: d = 1000 > M·n = 600, so min F = 0 (a common minimiser)."""
    x, y = make_feddua_linreg(seed=0)
    w_star = np.linalg.lstsq(x.reshape(-1, x.shape[-1]), y.reshape(-1), rcond=None)[0]
    assert linreg_loss(w_star, x, y) < 1e-20
    assert linreg_loss(np.zeros(x.shape[-1]), x, y) > 1.0


# --- the simulator ----------------------------------------------------------------


def test_closed_form_training_matches_explicit_gd_and_step(federations):
    """DUA §5.1 (τ = 20 full-batch steps): the closed form equals explicit GD.

    Also drives every rule for 3 rounds both ways: explicit einsum GD with
    ``rule.step`` on client arrays, and the closed form with ``rule.apply`` on
    (Δ̄, A) as :func:`_simulate` does; the iterates agree to 1e-10.
    """
    fed = federations[0]
    rng = np.random.default_rng(0)
    w = np.stack([np.zeros(fed.dim), rng.normal(size=fed.dim)])
    z = fed.coordinates(w)
    np.testing.assert_allclose(
        fed.loss(z), [linreg_loss(v, fed.x, fed.y) for v in w], rtol=1e-12
    )
    for eta_l in ETA_L:
        mean_update, mean_sq_norm = fed.round_statistics(z, fed.phi([eta_l] * 2))
        for c in range(2):
            deltas = fed.explicit_deltas(w[c], eta_l)
            np.testing.assert_allclose(
                mean_update[c], deltas.mean(axis=0), rtol=1e-10, atol=1e-13
            )
            expected = np.mean(np.einsum("md,md->m", deltas, deltas))
            assert mean_sq_norm[c] == pytest.approx(expected, rel=1e-10)
    makers = [_fedavg(1.0), _fedadam(0.1), _fedadagrad(0.1), _fedexp]
    makers += [_feddua("adagrad", 0.0), _feddua("adam", 0.0)]
    for make in makers:
        explicit, closed = make(), make()
        w_e = w_c = {"w": np.zeros(fed.dim)}
        for _ in range(3):
            deltas = fed.explicit_deltas(w_e["w"], 0.01)
            clients = [{"w": w_e["w"] + d} for d in deltas]
            w_e, _ = explicit.step(w_e, clients, [fed.num_samples] * fed.num_clients)
            mean_update, mean_sq_norm = fed.round_statistics(
                fed.coordinates(w_c["w"][None]), fed.phi([0.01])
            )
            stats = RoundStatistics(
                {"w": mean_update[0]}, float(mean_sq_norm[0]), fed.num_clients
            )
            w_c, _ = apply_statistics(closed, w_c, stats)
            np.testing.assert_allclose(w_c["w"], w_e["w"], rtol=1e-10, atol=1e-12)


# --- C1: FedDuA reaches the lowest training loss (DUA §5.2, Fig. 1) ---------------

# (FedDuA variant, baseline, margin, per_seed): the ratio FedDuA loss / baseline
# loss, both at their best grid point after 500 rounds, must be ≤ margin on
# every seed (per_seed) or in the geometric mean over the seeds.
C1_CASES = [
    ("FedDuAdagrad", "FedAvg", 1e-2, True),
    ("FedDuAdagrad", "FedExP", 1e-2, True),
    ("FedDuAdagrad", "FedAdagrad", 1e-2, True),
    ("FedDuAdagrad", "FedAdam", 1e-2, True),
    ("FedDuAdam", "FedAvg", 1e-6, True),
    ("FedDuAdam", "FedExP", 1e-6, True),
    ("FedDuAdam", "FedAdam", 0.5, False),
]
C1_FEDDUADAM_VS_FEDADAGRAD = pytest.param(
    "FedDuAdam",
    "FedAdagrad",
    1.0,
    True,
    marks=pytest.mark.xfail(
        strict=True,
        raises=AssertionError,
        reason=(
            "DUA Fig. 1 not reproduced for FedDuAdam vs FedAdagrad: after 500 "
            "rounds FedDuAdam's best loss is 2.9e-11 / 1.0e-11 / 1.4e-11 and "
            "FedAdagrad's 4.4e-12 / 7.1e-12 / 1.6e-11 (seeds 0/1/2): FedAdagrad "
            "is lower on seeds 0 and 1 (6.8x, 1.5x; geometric mean 2.1x), and on "
            "seeds 3 and 4 (14x, 7x)"
        ),
    ),
    id="FedDuAdam-vs-FedAdagrad",
)


@pytest.mark.parametrize(
    ("feddua", "baseline", "margin", "per_seed"),
    [pytest.param(*case, id=f"{case[0]}-vs-{case[1]}") for case in C1_CASES]
    + [C1_FEDDUADAM_VS_FEDADAGRAD],
)
def test_c1_feddua_beats_baselines_after_500_rounds(
    grid, feddua, baseline, margin, per_seed
):
    """C1, DUA §5.2 / Fig. 1 / App. H.2-H.3: lower training loss after 500 rounds.

    Each method at its best App. H.3 grid point for the round-500 loss
    (scored as in the module docstring), seeds 0/1/2. Losses on this machine:

    ============  =======  =======  =======  ===========================
    method        seed 0   seed 1   seed 2   best (log10 η_l, log10 η_g)
    ============  =======  =======  =======  ===========================
    FedAvg        4.1e-1   4.1e-1   4.5e-1   (−2, 1)
    FedExP        2.0e-2   4.0e-3   5.2e-3   (−1, −)
    FedAdagrad    4.4e-12  7.1e-12  1.6e-11  (−2 / −1.5 / −1.5, 0)
    FedAdam       3.6e-11  9.1e-8   1.9e-9   (−3 / −1 / −2.5, −1.5)
    FedDuAdagrad  2.7e-15  1.3e-15  9.0e-16  (−1, −)
    FedDuAdam     2.9e-11  1.0e-11  1.4e-11  (−1, −)
    ============  =======  =======  =======  ===========================

    The trajectories of FedExP and FedDuAdagrad are chaotic (rounding
    differences grow from 1e-15 to 1e-2 within ~80 rounds), so their digits
    move by up to ~20× with the BLAS build or thread count; the margins allow
    for that.

    * FedDuAdagrad beats every baseline on every seed: ratio ≤ 6e-4 (also on
      seeds 3-5: ≤ 8e-7). Pinned: ≤ 1e-2.
    * FedDuAdam beats FedAvg and FedExP by ≥ 8 decades. Pinned: ≤ 1e-6.
    * FedDuAdam vs FedAdam is seed-dependent, because FedAdam (fixed η_g,
      τ = 0) oscillates at a floor anywhere between 1e-13 and 1e-7: ratios
      0.82 / 1.1e-4 / 7.4e-3 on seeds 0/1/2, but 5.8e-4 / 0.80 / 12 (FedAdam
      lower) on seeds 3/4/5. Pinned on the geometric mean over the seeds:
      ≤ 0.5 (seeds 0-2: 8.7e-3; seeds 3-5 would give 0.18).
    * FedDuAdam does not beat FedAdagrad (xfail, strict).

    Both FedDuA variants pick η_l = 0.1, the edge of the grid; with
    η_l = 10^-0.5 (outside it) they reach 1e-18-1e-22.
    """
    ratios = {}
    for seed, trace in grid.items():
        dua, _ = trace.best(feddua, ROUNDS)
        base, base_run = trace.best(baseline, ROUNDS)
        assert math.isfinite(base) and base > 0, (seed, base_run)
        ratios[seed] = dua / base
    report = ", ".join(f"seed {s}: {r:.2e}" for s, r in ratios.items())
    if per_seed:
        assert max(ratios.values()) <= margin, f"{feddua}/{baseline}: {report}"
    else:
        geometric = math.exp(np.mean(np.log(list(ratios.values()))))
        assert geometric <= margin, f"{feddua}/{baseline}: {report}"


def test_c1_why_feddua_adam_trails_fedadagrad(federations, grid):
    """Root cause of the FedDuAdam-vs-FedAdagrad xfail above: the η_l grid.

    FedDuAdam's step is η_g = m_t/‖v_t‖²_{G⁻¹} with m_t = (β1/2)m + (1−β1)A/2
    (DUA Alg. 1 line 14; the β1/2 is the paper's, from Thm 3.3): for steady
    updates m settles at (1−β1)/(1−β1/2) = 0.18 of FedDuAdagrad's A/2, so
    FedDuAdam takes shorter steps and picks η_l = 0.1, the top of the App. H.3
    grid, on every seed.
    Two experiments (500 rounds, float64, seeds 0/1/2) locate the cause:

    * η_l one and two half-decades past the grid (10^-0.5, 1): FedDuAdam
      reaches 4.4e-22 / 4.5e-22 / 3.9e-22 (at η_l = 1), ten decades below
      tuned FedAdagrad (4.3e-12 / 7.1e-12 / 1.5e-11), which itself gains
      nothing from those η_l (its best stays at 0.01-0.03).
    * β1 = 0 (no momentum; then m_t = A_t/2 and v_t = Δ̄_t) on the paper grid:
      1.6e-16 / 3.0e-16 / 2.7e-16, four decades below FedAdagrad. β2 (0.99,
      0.999, 0.9999) changes nothing (2.9e-11-3.2e-11 on seed 0).

    So the implementation follows Alg. 1; the claim fails at the grid's edge,
    where the momentum variant needs a larger local step than the grid holds.
    """
    extended = (10.0**-0.5, 1.0)
    runs = [_Run("FedDuAdam", e, 0.0, _feddua("adam", 0.0)) for e in extended]
    runs += [
        _Run("FedDuAdam-b1=0", e, 0.0, lambda: FedDuARule(
            variant="adam", beta_1=0.0, epsilon=0.0, epsilon_g=0.0,
            weighting="uniform"))
        for e in ETA_L
    ]  # fmt: skip
    for seed, fed in federations.items():
        trace = _simulate(fed, runs)
        adagrad = grid[seed].best("FedAdagrad", ROUNDS)[0]
        assert grid[seed].best("FedDuAdam", ROUNDS)[1].eta_l == ETA_L[-1]
        assert trace.best("FedDuAdam", ROUNDS)[0] <= 1e-6 * adagrad, seed
        assert trace.best("FedDuAdam-b1=0", ROUNDS)[0] <= 1e-2 * adagrad, seed


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason=(
        "FedAdam is ahead early: at round 100 the best FedAdam loss is "
        "3.6e-5 / 3.3e-5 / 3.7e-5 (seeds 0/1/2) vs FedDuAdagrad 1.5e-4 / "
        "2.7e-4 / 1.6e-4 and FedDuAdam 2.3e-2 / 1.7e-2 / 1.9e-2"
    ),
)
def test_c1_feddua_ahead_after_100_rounds(grid):
    """C1 at R = 100, DUA §5.2 / Fig. 1 ("consistently outperform") and App. I.1.

    Each method at its best grid point for round 100. FedDuAdagrad is below
    FedAvg, FedExP and FedAdagrad, but FedAdam is lower than both FedDuA
    variants on every seed, and FedDuAdam is also behind FedAdagrad. FedAdam
    also reaches every loss level from 1e-2 to 1e-10 in fewer rounds (1e-8:
    ~180 rounds vs 217-255 for FedDuAdagrad and 370-410 for FedDuAdam,
    seeds 0-4); FedDuAdagrad only wins in the end because FedAdam (fixed η_g,
    τ = 0) stalls at 1e-11-1e-7.
    """
    for seed, trace in grid.items():
        best_baseline = min(trace.best(b, 100)[0] for b in BASELINES)
        for feddua in ("FedDuAdagrad", "FedDuAdam"):
            loss = trace.best(feddua, 100)[0]
            assert loss < best_baseline, f"seed {seed}: {feddua} {loss:.3e}"


# --- C2: FedExP is faster than FedAvg (FedExP paper; DUA §2) ------------------------


def test_c2_fedexp_reaches_fedavg_loss_in_fewer_rounds(grid):
    """C2, FedExP (Jhunjhunwala et al., 2023) §5 headline, on DUA's synthetic task.

    At every η_l of the grid and on every seed, FedExP (max(1,·), ε = 0,
    scored on the last-two average) reaches the loss FedAvg with
    η_g = 1 has after 500 rounds within 500/4 = 125 rounds. Observed: 19-75
    rounds (a 6.7-26× speed-up); the largest counts are at η_l ≥ 10^-1.5.
    """
    for seed, trace in grid.items():
        for eta_l in ETA_L:
            fedavg = trace.last[:, trace.find("FedAvg", eta_l, 1.0)]
            fedexp = trace.evaluated(trace.find("FedExP", eta_l, None))
            target = fedavg[ROUNDS]
            assert np.isfinite(target) and target < fedavg[0]
            reached = np.flatnonzero(fedexp <= target)
            assert reached.size, f"seed {seed}, η_l={eta_l:.0e}: never"
            assert reached[0] <= ROUNDS // 4, (
                f"seed {seed}, η_l={eta_l:.0e}: FedExP needs {reached[0]} rounds "
                f"to reach FedAvg's round-{ROUNDS} loss {target:.3e}"
            )


# --- C3: FedDuA is insensitive to ε_g (DUA §5.2, Fig. 2) ---------------------------

C3_ROUNDS = 50  # DUA §5.2: "we run each algorithm ... for 50 rounds"
C3_ETA_G = (1e-3, 1e-2, 1e-1, 1.0)  # four decades, as ε_g ∈ {0, 1e-3, 1e-2, 1e-1}


def test_c3_feddua_is_less_sensitive_to_eps_g_than_fedadam_to_eta_g(federations):
    """C3, DUA §5.2 "robust to the choice of hyperparameters", Fig. 2.

    As in the paper: 50 rounds, η_l tuned (over the App. H.3 grid) for each
    ε_g ∈ {0, 1e-3, 1e-2, 1e-1} (FedDuA) or η_g ∈ {1e-3, 1e-2, 1e-1, 1}
    (FedAdam), score = loss averaged over the last 5 rounds. The spread
    log10(max/min) over the four settings, seeds 0/1/2:

    FedDuAdagrad 0.84 / 0.87 / 0.90, FedDuAdam 0.07 / 0.08 / 0.08, FedAdam
    2.29 / 2.29 / 2.31 (with 4 of the synthetic η_g grid instead:
    1.56-2.19). Asserted: each FedDuA spread ≤ 0.5 × FedAdam's.

    Not asserted: after 500 rounds (C1's budget) the order flips, because the
    problem interpolates: q_t → 0, so any fixed ε_g > 0 ends up dominating
    q_t + ε_g and the step m_t/ε_g ∝ ‖Δ‖² stalls (ε_g = 0: ~1e-15,
    ε_g = 1e-3: ~1e-4). Spreads at 500 rounds: FedDuAdagrad 12.3-12.9,
    FedDuAdam 7.7-8.1, FedAdam 5.6-5.7.
    """
    for seed, fed in federations.items():
        runs = []
        for eta_l in ETA_L:
            for variant in ("adagrad", "adam"):
                name = "FedDu" + variant.capitalize()
                runs += [_Run(name, eta_l, e, _feddua(variant, e)) for e in EPS_G]
            runs += [_Run("FedAdam", eta_l, g, _fedadam(g)) for g in C3_ETA_G]
        trace = _simulate(fed, runs, rounds=C3_ROUNDS)

        def score(method, knob, trace=trace):
            return min(
                trace.evaluated(trace.find(method, eta_l, knob))[-5:].mean()
                for eta_l in ETA_L
            )

        fedadam = _span_log10([score("FedAdam", g) for g in C3_ETA_G])
        assert fedadam > 1.0
        for method in ("FedDuAdagrad", "FedDuAdam"):
            spread = _span_log10([score(method, e) for e in EPS_G])
            assert spread <= 0.5 * fedadam, (
                f"seed {seed}: {method} spans {spread:.2f} decades over ε_g, "
                f"FedAdam {fedadam:.2f} over η_g"
            )
