"""Server update rules (fedadapt.strategies.core) against NumPy oracles.

Every expected value is computed here in float64 from the papers' formulas
(Reddi et al., arXiv:2003.00295, Algorithm 2; FedExP, arXiv:2301.09604; FedDuA
Algorithm 1) or from Flower 1.41's rules where we copy Flower, never by the code
under test. Each docstring names the paper location (or the choice) it checks.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedadapt.strategies.core import (
    FedAdagradRule,
    FedAdamRule,
    FedAvgRule,
    FedDuARule,
    FedExPRule,
    FedYogiRule,
)

SHAPES = {"w": (4, 3), "b": (3,)}


def _rounds(num_rounds=10, num_clients=5, participants=3, seed=0, scale=0.1):
    """Random global start and per-round client arrays with partial participation."""
    rng = np.random.default_rng(seed)
    x0 = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    rounds = []
    for _ in range(num_rounds):
        chosen = rng.choice(num_clients, size=participants, replace=False)
        deltas = [
            {k: scale * rng.normal(size=s) for k, s in SHAPES.items()} for _ in chosen
        ]
        n = rng.integers(5, 50, size=participants).astype(float)
        rounds.append((deltas, n))
    return x0, rounds


def _flat(arrays):
    return np.concatenate([arrays[k].ravel() for k in SHAPES])


def _unflat(vec):
    out, i = {}, 0
    for k, s in SHAPES.items():
        size = int(np.prod(s))
        out[k] = vec[i : i + size].reshape(s)
        i += size
    return out


def _run(rule, x0, rounds, reported_norms=False):
    """Drive a rule the way a strategy does; return iterates and diagnostics."""
    x, xs, diags = x0, [], []
    for deltas, n in rounds:
        clients = [{k: x[k] + d[k] for k in SHAPES} for d in deltas]
        norms = [float(_flat(d) @ _flat(d)) for d in deltas] if reported_norms else None
        x, diag = rule.step(x, clients, n, norms)
        xs.append(x)
        diags.append(diag)
    return xs, diags


def _stats(deltas, n, weighting):
    w = np.full(len(n), 1 / len(n)) if weighting == "uniform" else n / n.sum()
    flat = [_flat(d) for d in deltas]
    mean = sum(wi * f for wi, f in zip(w, flat, strict=True))
    a = sum(wi * f @ f for wi, f in zip(w, flat, strict=True))
    return mean, a


# --- FedOpt (Reddi et al. Algorithm 2; Flower 1.41's FedAdam and FedAvgM) -----


@pytest.mark.parametrize("variant", ["adagrad", "adam", "yogi"])
@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_fedopt_matches_reddi_algorithm_2(variant, weighting):
    """Reddi et al. (arXiv:2003.00295) Alg. 2, bias_correction none, m, v from 0."""
    x0, rounds = _rounds()
    eta, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    rule = {
        "adagrad": lambda: FedAdagradRule(eta=eta, tau=tau, weighting=weighting),
        "adam": lambda: FedAdamRule(eta=eta, beta_1=b1, beta_2=b2, tau=tau,
                                    bias_correction="none", weighting=weighting),
        "yogi": lambda: FedYogiRule(eta=eta, beta_1=b1, beta_2=b2, tau=tau,
                                    weighting=weighting),
    }[variant]()  # fmt: skip
    xs, diags = _run(rule, x0, rounds)
    x, m, v = _flat(x0), 0.0, 0.0
    beta_1 = 0.0 if variant == "adagrad" else b1
    for (deltas, n), got, diag in zip(rounds, xs, diags, strict=True):
        d, _ = _stats(deltas, n, weighting)
        m = beta_1 * m + (1 - beta_1) * d
        if variant == "adagrad":
            v = v + d**2
        elif variant == "adam":
            v = b2 * v + (1 - b2) * d**2
        else:
            v = v - (1 - b2) * d**2 * np.sign(v - d**2)
        x = x + eta * m / (np.sqrt(v) + tau)
        np.testing.assert_allclose(_flat(got), x, rtol=1e-10, atol=1e-12)
        assert diag["m-norm"] == pytest.approx(np.linalg.norm(m), rel=1e-10)
        assert diag["v-norm"] == pytest.approx(np.linalg.norm(v), rel=1e-10)


@pytest.mark.parametrize("correction", ["flower", "torch"])
def test_fedadam_bias_corrections(correction):
    """Flower: η√(1−β2^{t+1})/(1−β1^{t+1}) (Flower 1.41); torch: Adam's m̂/(√v̂+τ)."""
    x0, rounds = _rounds(num_rounds=5)
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    rule = FedAdamRule(
        eta=eta, beta_1=b1, beta_2=b2, tau=tau, bias_correction=correction
    )
    xs, diags = _run(rule, x0, rounds)
    x, m, v = _flat(x0), 0.0, 0.0
    for t, ((deltas, n), got) in enumerate(zip(rounds, xs, strict=True), start=1):
        d, _ = _stats(deltas, n, "num_examples")
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d**2
        if correction == "flower":
            x = x + eta * np.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) * m / (
                np.sqrt(v) + tau
            )
        else:
            x = x + eta * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + tau)
        np.testing.assert_allclose(_flat(got), x, rtol=1e-10, atol=1e-12)


def test_fedavg_and_fedavgm():
    """FedAvg = weighted mean; FedAvgM = Flower 1.41's heavy ball."""
    x0, rounds = _rounds(num_rounds=4)
    xs, _ = _run(FedAvgRule(), x0, rounds)
    x = _flat(x0)
    for (deltas, n), got in zip(rounds, xs, strict=True):
        x = x + _stats(deltas, n, "num_examples")[0]
        np.testing.assert_allclose(_flat(got), x, rtol=1e-12)
    xs, _ = _run(FedAvgRule(server_lr=0.7, server_momentum=0.9), x0, rounds)
    x, mom = _flat(x0), None
    for (deltas, n), got in zip(rounds, xs, strict=True):
        pg = -_stats(deltas, n, "num_examples")[0]
        mom = pg if mom is None else 0.9 * mom + pg
        x = x - 0.7 * mom
        np.testing.assert_allclose(_flat(got), x, rtol=1e-12)


# --- FedExP (arXiv:2301.09604; restated without max(1,·) in FedDuA §2) --------


def test_fedexp_identical_updates():
    """Identical Δ_i give raw ratio ½: η = 1 (original), ½ (DUA form, ε=0).

    FedExP (arXiv:2301.09604) clips at max(1,·); FedDuA §2 restates it without.
    """
    x0 = {k: np.zeros(s) for k, s in SHAPES.items()}
    d = {k: np.full(s, 0.3) for k, s in SHAPES.items()}
    clients = [{k: x0[k] + d[k] for k in SHAPES}] * 4
    new, diag = FedExPRule(epsilon=0.0).step(x0, clients, [1] * 4)
    assert diag["server-lr"] == 1.0
    np.testing.assert_allclose(_flat(new), _flat(d))
    new, diag = FedExPRule(epsilon=0.0, form="dua").step(x0, clients, [1] * 4)
    assert diag["server-lr"] == pytest.approx(0.5, rel=1e-12)
    np.testing.assert_allclose(_flat(new), 0.5 * _flat(d))


def test_fedexp_closed_form_on_hand_made_updates():
    """Δ_1 = (2, 0), Δ_2 = (−2, 2): A = (4+8)/2 = 6, Δ̄ = (0, 1), ε = ½.

    Paper: η = A/(2(‖Δ̄‖²+ε)) = 6/3 = 2; code form (ε·|S|): 6/(2(1+1)) = 1.5.
    Both ratios are above 1, so max(1,·) hides no error: a denominator of
    4(‖Δ̄‖²+ε) (η = 1), ε·|S| in the paper form (1.5), ε added to A (3.25) or
    left out (3) all give another η.
    """
    x0 = {"w": np.array([10.0, 20.0])}
    clients = [{"w": np.array([12.0, 20.0])}, {"w": np.array([8.0, 22.0])}]
    eps = 0.5
    new, diag = FedExPRule(epsilon=eps).step(x0, clients, [3, 1])
    assert diag["server-lr"] == pytest.approx(2.0, rel=1e-12)
    np.testing.assert_allclose(new["w"], [10.0, 22.0], rtol=1e-12)
    # DUA's form has no max(1,·) and the same ratio here
    _, diag = FedExPRule(epsilon=eps, form="dua").step(x0, clients, [3, 1])
    assert diag["server-lr"] == pytest.approx(2.0, rel=1e-12)
    # official code form: ε·|S| (Divyansh03 main.py)
    new, diag = FedExPRule(epsilon=eps, eps_form="times_S").step(x0, clients, [3, 1])
    assert diag["server-lr"] == pytest.approx(1.5, rel=1e-12)
    np.testing.assert_allclose(new["w"], [10.0, 21.5], rtol=1e-12)


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_fedexp_never_below_fedavg_and_jensen(weighting):
    """FedExP's max(1,·) gives η ≥ 1; A ≥ ‖Δ̄‖² (Jensen) for uniform and weighted ω."""
    x0, rounds = _rounds(num_rounds=20, seed=3)
    _, diags = _run(FedExPRule(epsilon=0.0, weighting=weighting), x0, rounds)
    for d in diags:
        assert d["server-lr"] >= 1.0
        assert d["mean-client-sq-norm"] >= d["mean-update-sq-norm"]


# --- FedDuA (DUA Algorithm 1 lines 9-17, eq. (3)) -----------------------------


def _feddua_reference(x0, rounds, variant, b1, b2, eps, eps_g, identity=False):
    """DUA Alg. 1 lines 9-17 in float64 NumPy, line 16's norm read as ‖v‖²_{G⁻¹}.

    Uniform weights as lines 9, 12 and 14; why G⁻¹: docs/algorithms.md.
    """
    x, s, v, m = _flat(x0), 0.0, 0.0, 0.0
    out = []
    for deltas, n in rounds:
        d, a = _stats(deltas, n, "uniform")
        if variant == "adagrad":
            s, v, m = s + d**2, d, a / 2
        else:
            s = b2 * s + (1 - b2) * d**2
            v = b1 * v + (1 - b1) * d
            m = (b1 / 2) * m + (1 - b1) * a / 2
        g = np.ones_like(d) if identity else np.sqrt(s) + eps
        u = v / g
        eta = m / (v @ u + eps_g)
        x = x + eta * u
        out.append((x, eta, m))
    return out


@pytest.mark.parametrize("variant", ["adagrad", "adam"])
def test_feddua_multi_round_oracle(variant):
    """DUA Alg. 1, 10 rounds: partial participation, β=(0.9,0.99), ε=1e-3, ε_g=1e-2."""
    x0, rounds = _rounds(num_rounds=10)
    rule = FedDuARule(variant=variant, epsilon=1e-3, epsilon_g=1e-2)
    xs, diags = _run(rule, x0, rounds)
    expected = _feddua_reference(x0, rounds, variant, 0.9, 0.99, 1e-3, 1e-2)
    for got, diag, (x, eta, m) in zip(xs, diags, expected, strict=True):
        np.testing.assert_allclose(_flat(got), x, rtol=1e-10, atol=1e-12)
        assert diag["server-lr"] == pytest.approx(eta, rel=1e-10)
        assert diag["m"] == pytest.approx(m, rel=1e-10)


@pytest.mark.parametrize("variant", ["adagrad", "adam"])
def test_feddua_round_zero_is_a_scaled_sign_step(variant):
    """DUA Alg. 1 round 0 with ε = ε_g = 0: w_1 − w_0 = (A/(2‖Δ̄‖₁))·sign(Δ̄).

    The (1−β) factors of line 14 cancel, so both variants take this step.
    """
    x0, rounds = _rounds(num_rounds=1, seed=5)
    (new,), _ = _run(FedDuARule(variant=variant, epsilon=0.0), x0, rounds)
    d, a = _stats(*rounds[0], "uniform")
    expected = a / (2 * np.abs(d).sum()) * np.sign(d)
    np.testing.assert_allclose(_flat(new) - _flat(x0), expected, rtol=1e-9)


@pytest.mark.parametrize("variant", ["adagrad", "adam"])
@pytest.mark.parametrize("c", [0.1, 10.0])
def test_feddua_step_is_one_homogeneous(variant, c):
    """Scaling every Δ_i by c scales the step by c (catches the G vs G⁻¹ typo).

    DUA Alg. 1 line 16 prints ‖v‖²_G; App. F and App. G.2 use ‖·‖²_{G⁻¹}.
    """
    x0, rounds = _rounds(num_rounds=3, seed=7)
    scaled = [([{k: c * d[k] for k in d} for d in ds], n) for ds, n in rounds]
    base, _ = _run(FedDuARule(variant=variant, epsilon=0.0), x0, rounds)
    big, _ = _run(FedDuARule(variant=variant, epsilon=0.0), x0, scaled)
    np.testing.assert_allclose(
        _flat(big[0]) - _flat(x0), c * (_flat(base[0]) - _flat(x0)), rtol=1e-9
    )


def test_identity_preconditioner_gives_fedexp_and_fedexpm():
    """FedDuAdagrad(G=I) = FedExP without max; FedDuAdam(G=I) = FedExPM.

    FedExP without max(1,·) is FedDuA §2's restatement; FedExPM, a FedDuA §5.1
    baseline that the paper never defines, is FedDuAdam with G = I by our choice.
    """
    x0, rounds = _rounds(num_rounds=6, seed=11)
    dua_i, _ = _run(FedDuARule(variant="adagrad", preconditioner="identity",
                               epsilon_g=1e-3), x0, rounds)  # fmt: skip
    exp, _ = _run(FedExPRule(epsilon=1e-3, form="dua"), x0, rounds)
    for a, b in zip(dua_i, exp, strict=True):
        np.testing.assert_allclose(_flat(a), _flat(b), rtol=1e-10)
    expm, _ = _run(FedExPRule(epsilon=1e-3, server_momentum=0.9), x0, rounds)
    ref = _feddua_reference(x0, rounds, "adam", 0.9, 0.0, 0.0, 1e-3, identity=True)
    for got, (x, _, _) in zip(expm, ref, strict=True):
        np.testing.assert_allclose(_flat(got), x, rtol=1e-10)
    # heavy-ball code form (FedExP 'fedavgm(exp)', ε=0) gives the same iterates
    expm0, _ = _run(FedExPRule(epsilon=0.0, server_momentum=0.9), x0, rounds)
    x, v, m = _flat(x0), 0.0, 0.0
    for (deltas, n), got in zip(rounds, expm0, strict=True):
        d, a = _stats(deltas, n, "uniform")
        v, m = d + 0.9 * v, a / 2 + 0.45 * m
        x = x + m / (v @ v) * v
        np.testing.assert_allclose(_flat(got), x, rtol=1e-9)


@pytest.mark.parametrize(
    "rule", [lambda: FedDuARule(epsilon=0.0), lambda: FedDuARule(variant="adagrad",
             epsilon=0.0), lambda: FedExPRule(epsilon=0.0, form="dua")]
)  # fmt: skip
def test_all_zero_updates_do_not_move_or_nan(rule):
    """Δ_i = 0 ⇒ η = 0, no move, no NaN; ε = 0 with s_k = 0 ⇒ ratio 0.

    Our guards where DUA Alg. 1 lines 15-16 would divide 0 by 0.
    """
    x0 = {k: np.ones(s) for k, s in SHAPES.items()}
    new, diag = rule().step(x0, [x0, x0], [1, 1])
    assert diag["server-lr"] == 0.0
    np.testing.assert_array_equal(_flat(new), _flat(x0))
    # one coordinate never moves: s_k = 0 there, its ratio must be 0 (not NaN)
    r = FedDuARule(epsilon=0.0)
    moved = {"w": x0["w"].copy(), "b": x0["b"].copy()}
    moved["w"][0, 0] += 1.0
    new, _ = r.step(x0, [moved], [1])
    assert np.all(np.isfinite(_flat(new)))
    np.testing.assert_array_equal(new["b"], x0["b"])


# --- shared machinery ------------------------------------------------------------

ALL_RULES = {
    "fedavg": lambda: FedAvgRule(),
    "fedavgm": lambda: FedAvgRule(server_momentum=0.9),
    "fedadam": lambda: FedAdamRule(),
    "fedadagrad": lambda: FedAdagradRule(),
    "fedyogi": lambda: FedYogiRule(),
    "fedexp": lambda: FedExPRule(),
    "fedexpm": lambda: FedExPRule(server_momentum=0.9),
    "fedduadam": lambda: FedDuARule(epsilon=1e-3),
    "fedduadagrad": lambda: FedDuARule(variant="adagrad", epsilon=1e-3),
}


@pytest.mark.parametrize("name", ALL_RULES)
def test_reported_norms_equal_computed_norms(name):
    """Issue #4: the metric-norm path and the array-norm path agree."""
    x0, rounds = _rounds(num_rounds=5)
    computed, _ = _run(ALL_RULES[name](), x0, rounds)
    reported, _ = _run(ALL_RULES[name](), x0, rounds, reported_norms=True)
    for a, b in zip(computed, reported, strict=True):
        np.testing.assert_allclose(_flat(a), _flat(b), rtol=1e-12)


@pytest.mark.parametrize("name", ["fedexp", "fedexpm", "fedduadam", "fedduadagrad"])
def test_sums_alone_suffice_secure_aggregation(name):
    """Secure aggregation: apply() from Σω_iΔ_i and Σω_i s_i only.

    It equals the per-client computation.
    """
    from fedadapt.strategies.core import RoundStatistics
    from fedadapt.strategies.core.aggregation import apply_statistics

    x0, rounds = _rounds(num_rounds=4)
    per_client, _ = _run(ALL_RULES[name](), x0, rounds)
    rule, x = ALL_RULES[name](), x0
    for (deltas, n), expected in zip(rounds, per_client, strict=True):
        mean, a = _stats(deltas, n, "uniform")
        stats = RoundStatistics(_unflat(mean), float(a), len(deltas))
        x, _ = apply_statistics(rule, x, stats)
        np.testing.assert_allclose(_flat(x), _flat(expected), rtol=1e-12)


@pytest.mark.parametrize("name", ALL_RULES)
def test_state_dict_resume_is_exact(name):
    """Checkpoint resume: 3 rounds, save, load into a new rule, 3 more == 6 straight."""
    x0, rounds = _rounds(num_rounds=6)
    straight, _ = _run(ALL_RULES[name](), x0, rounds)
    first = ALL_RULES[name]()
    head, _ = _run(first, x0, rounds[:3])
    resumed = ALL_RULES[name]()
    resumed.load_state_dict(first.state_dict())
    tail, _ = _run(resumed, head[-1], rounds[3:])
    np.testing.assert_array_equal(_flat(tail[-1]), _flat(straight[-1]))


def test_plain_arrays_are_averaged_and_keep_their_dtype():
    """BN buffers and integer arrays: averaged, out of the adaptive rule.

    Our choice; see docs/algorithms.md.
    """
    x0 = {
        "conv.weight": np.zeros(3, np.float32),
        "bn.running_mean": np.zeros(2, np.float32),
        "bn.num_batches_tracked": np.array(10, np.int64),
    }
    clients = [
        {"conv.weight": np.full(3, 1.0, np.float32),
         "bn.running_mean": np.array([1.0, 3.0], np.float32),
         "bn.num_batches_tracked": np.array(14, np.int64)},
        {"conv.weight": np.full(3, 3.0, np.float32),
         "bn.running_mean": np.array([3.0, 5.0], np.float32),
         "bn.num_batches_tracked": np.array(15, np.int64)},
    ]  # fmt: skip
    new, diag = FedDuARule().step(x0, clients, [1, 1])
    np.testing.assert_allclose(new["bn.running_mean"], [2.0, 4.0])
    assert new["bn.num_batches_tracked"].dtype == np.int64
    assert int(new["bn.num_batches_tracked"]) in (14, 15)
    assert new["conv.weight"].dtype == np.float32
    # norms cover conv.weight only: A = (3·1 + 3·9)/2 = 15
    assert diag["mean-client-sq-norm"] == pytest.approx(15.0)


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: FedAdamRule(eta=0.0), r"Invalid eta: 0.0"),
        (lambda: FedAdamRule(eta=-1.0), r"Invalid eta"),
        (lambda: FedAdamRule(beta_1=1.0), r"Invalid beta_1: 1.0"),
        (lambda: FedYogiRule(beta_2=-0.1), r"Invalid beta_2"),
        (lambda: FedAdagradRule(tau=-1e-3), r"Invalid tau"),
        (lambda: FedAdamRule(bias_correction="adam"), r"Invalid bias_correction"),
        (lambda: FedDuARule(variant="rmsprop"), r"Invalid variant: 'rmsprop'"),
        (lambda: FedDuARule(epsilon=-1.0), r"Invalid epsilon"),
        (lambda: FedDuARule(epsilon_g=float("nan")), r"Invalid epsilon_g"),
        (lambda: FedExPRule(epsilon=-0.1), r"Invalid epsilon"),
        (lambda: FedExPRule(server_momentum=1.0), r"Invalid server_momentum"),
        (lambda: FedExPRule(form="max"), r"Invalid form"),
        (lambda: FedAvgRule(server_lr=0.0), r"Invalid server_lr"),
        (lambda: FedAvgRule(weighting="size"), r"Invalid weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_parameter(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


@pytest.mark.parametrize("max_norm", [0.0, 1e3])
def test_blocked_sums_equal_a_client_by_client_loop(monkeypatch, max_norm):
    """Issue #20: Δ̄ summed block by block (blocks of 5 here, arrays of 23 and
    7 values) equals the plain loop Σ_i ω_i(x_i − x_t) in float32 exactly, and
    each ‖Δ_i‖² the float64 value."""
    from fedadapt.strategies.core import aggregation

    monkeypatch.setattr(aggregation, "SUM_BLOCK", 5)
    rng = np.random.default_rng(3)
    x_t = {"w": rng.normal(size=(23,)).astype(np.float32),
           "b": rng.normal(size=(7, 1)).astype(np.float32)}  # fmt: skip
    clients = [
        {k: x + np.float32(0.1) * rng.normal(size=x.shape).astype(np.float32)
         for k, x in x_t.items()}
        for _ in range(4)
    ]  # fmt: skip
    n = [3.0, 5.0, 7.0, 11.0]
    stats = aggregation.round_statistics(
        FedExPRule(), x_t, clients, n, max_norm=max_norm
    )
    for k, x in x_t.items():
        expected = np.zeros_like(x)
        for c in clients:
            expected += (c[k] - x) * 0.25
        np.testing.assert_array_equal(stats.mean_update[k], expected)
    norms = [
        sum(float(np.sum((c[k] - x).astype(np.float64) ** 2)) for k, x in x_t.items())
        for c in clients
    ]
    np.testing.assert_allclose(stats.client_sq_norms, norms, rtol=1e-6)


def test_server_move_is_the_step_the_rule_took_over_its_adaptive_arrays():
    """``server-move-sq-norm`` = ‖x_{t+1} − x_t‖² over the adaptive arrays
    (#38). Closed forms: FedAvg moves by Δ̄ (‖Δ̄‖²), FedExP by η·Δ̄
    (η²‖Δ̄‖²); a key the rule only averages (FedExP's and FedDuA's
    BatchNorm buffers) is left out, FedAvg counts every array."""
    x0 = {"w": np.zeros(3), "bn.running_mean": np.zeros(2)}
    clients = [
        {"w": np.array([1.0, 0.0, 0.0]), "bn.running_mean": np.array([5.0, 5.0])},
        {"w": np.array([-0.5, 1.0, 0.0]), "bn.running_mean": np.array([5.0, 5.0])},
    ]
    _, avg = FedAvgRule(weighting="uniform").step(x0, clients, [1, 1])
    assert avg["server-move-sq-norm"] == pytest.approx(0.25**2 + 0.5**2 + 2 * 25)
    _, exp = FedExPRule(epsilon=0.0).step(x0, clients, [1, 1])
    assert exp["mean-update-sq-norm"] == pytest.approx(0.25**2 + 0.5**2)
    eta = exp["server-lr"]  # A/(2‖Δ̄‖²) = 1.125/0.625 = 1.8
    assert eta == pytest.approx(1.8)
    assert exp["server-move-sq-norm"] == pytest.approx(
        eta**2 * exp["mean-update-sq-norm"]
    )
    new, dua = FedDuARule(variant="adagrad", epsilon=0.0).step(x0, clients, [1, 1])
    assert dua["server-move-sq-norm"] == pytest.approx(
        float(np.sum((new["w"] - x0["w"]) ** 2))
    )
