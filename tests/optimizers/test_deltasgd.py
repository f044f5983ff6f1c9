"""Δ-SGD client optimizer (arXiv:2306.11201 Algorithm 1) against float64 oracles."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedadapt.optimizers import deltasgd
from fedadapt.optimizers.deltasgd import (
    DeltaSGD,
    delta_sgd,
    preserve_buffers,
    step_size,
)

# ----------------------------------------------------------------- oracles


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _logreg_data(n=40, d=5, seed=0, scale=5.0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * scale
    w_true = rng.normal(size=d)
    y = (rng.random(n) < _sigmoid(X @ w_true / scale)).astype(np.float64)
    batches = [np.arange(i, i + 8) for i in range(0, n, 8)]
    x0 = rng.normal(size=d + 1) * 0.1  # (w, b)
    return X, y, batches, x0


def _logreg_grad(x, X, y, idx):
    """Mean BCE-with-logits gradient on rows ``idx``; x = (w, b)."""
    Xb, yb = X[idx], y[idx]
    r = _sigmoid(Xb @ x[:-1] + x[-1]) - yb
    return np.concatenate([Xb.T @ r / len(idx), [r.mean()]])


def _reference(
    grad,
    x0,
    batches,
    steps,
    *,
    lr=0.2,
    gamma=2.0,
    delta=0.1,
    theta0=1.0,
    mode="same_batch",
    first_step="paper",
    eps=0.0,
    wd=0.0,
):
    """Algorithm 1 lines 6-10 step by step in float64: etas, thetas, branches, xs."""

    def G(x, b):
        return grad(x, b) + wd * x

    x = np.array(x0, dtype=np.float64)
    eta, theta = lr, theta0
    x_prev = g_prev = None
    etas, thetas, branches, xs = [], [], [], []
    for k in range(steps):
        batch = batches[k % len(batches)]
        g = G(x, batch)
        if k == 0:
            branch = "first"
            if first_step == "official":
                new = eta * math.sqrt(1 + delta * theta)
                theta, eta = new / eta, new
        else:
            h = G(x_prev, batch) if mode == "same_batch" else g_prev
            a = np.linalg.norm(x - x_prev)
            b = np.linalg.norm(g - h)
            grow = math.sqrt(1 + delta * theta) * eta
            if a > 0 and b > 0:
                first = gamma * a / (2 * b)
                branch = "smoothness" if first < grow else "growth"
                new = min(first, grow) + eps
            else:
                branch, new = "growth", grow
            theta, eta = new / eta, new
        x_prev, g_prev = x.copy(), g
        x = x - eta * g
        etas.append(eta)
        thetas.append(theta)
        branches.append(branch)
        xs.append(x.copy())
    return np.array(etas), np.array(thetas), branches, np.array(xs)


def _adsgd_reference(grad, x0, batches, steps, *, lr, theta, amplifier, damping, eps):
    """The official code's ``adsgd.py`` arithmetic: prev_net starts = model."""
    x = np.array(x0, dtype=np.float64)
    prev = x.copy()
    etas, xs = [], []
    for k in range(steps):
        batch = batches[k % len(batches)]
        g, h = grad(x, batch), grad(prev, batch)
        pd, gd = np.linalg.norm(x - prev), np.linalg.norm(g - h)
        if pd > 0 and gd > 0:
            new = min(lr * math.sqrt(1 + amplifier * theta), pd / (damping * gd)) + eps
        else:
            new = lr * math.sqrt(1 + amplifier * theta)
        theta, lr = new / lr, new
        prev = x.copy()
        x = x - lr * g
        etas.append(lr)
        xs.append(x.copy())
    return np.array(etas), np.array(xs)


# ------------------------------------------------------------ torch driver


def _logreg_torch(X, y, x0, dtype=torch.float64, device="cpu"):
    d = X.shape[1]
    w = torch.tensor(x0[:d], dtype=dtype, device=device, requires_grad=True)
    b = torch.tensor(x0[d:], dtype=dtype, device=device, requires_grad=True)
    Xt = torch.tensor(X, dtype=dtype, device=device)
    yt = torch.tensor(y, dtype=dtype, device=device)
    return w, b, Xt, yt


def _logreg_closure(opt, w, b, Xt, yt, batch):
    """The closure ``opt.step`` takes: the logistic loss of ``batch`` (row
    indices), gradients cleared first."""
    idx = torch.as_tensor(batch, device=Xt.device)

    def closure():
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(Xt[idx] @ w + b, yt[idx])
        loss.backward()
        return loss

    return closure


def _run_logreg(X, y, batches, x0, steps, dtype=torch.float64, device="cpu", **kw):
    w, b, Xt, yt = _logreg_torch(X, y, x0, dtype, device)
    opt = DeltaSGD([w, b], **kw)
    xs = []
    for k in range(steps):
        opt.step(_logreg_closure(opt, w, b, Xt, yt, batches[k % len(batches)]))
        xs.append(torch.cat([w, b]).detach().cpu().double().numpy())
    return opt, np.array(xs)


# ------------------------------------ reference traces (Alg. 1 lines 8-10)


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
@pytest.mark.parametrize("first_step", ["paper", "official"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_trace_matches_numpy_reference(mode, first_step, wd):
    X, y, batches, x0 = _logreg_data()

    def grad(x, idx):
        return _logreg_grad(x, X, y, idx)

    etas, thetas, branches, xs = _reference(
        grad, x0, batches, 20, mode=mode, first_step=first_step, wd=wd
    )
    opt, got = _run_logreg(
        X, y, batches, x0, 20, mode=mode, first_step=first_step, weight_decay=wd
    )
    hist = opt.history[0]
    np.testing.assert_allclose([h.eta for h in hist], etas, rtol=1e-10)
    np.testing.assert_allclose([h.theta for h in hist], thetas, rtol=1e-10)
    assert [h.branch for h in hist] == branches
    np.testing.assert_allclose(got, xs, rtol=1e-10, atol=1e-12)
    assert {"smoothness", "growth"} <= set(branches)  # both branches exercised
    assert opt.param_groups[0]["lr"] == hist[-1].eta
    assert opt.param_groups[0]["eta0"] == 0.2


def test_trace_float32_within_1e5():
    X, y, batches, x0 = _logreg_data()
    etas, _, _, xs = _reference(lambda x, i: _logreg_grad(x, X, y, i), x0, batches, 20)
    opt, got = _run_logreg(X, y, batches, x0, 20, dtype=torch.float32)
    np.testing.assert_allclose([h.eta for h in opt.history[0]], etas, rtol=1e-5)
    np.testing.assert_allclose(got, xs, rtol=1e-5, atol=1e-6)


def test_compat_trace_matches_adsgd_arithmetic():
    X, y, batches, x0 = _logreg_data()
    etas, xs = _adsgd_reference(
        lambda x, i: _logreg_grad(x, X, y, i),
        x0,
        batches,
        20,
        lr=0.2,
        theta=1.0,
        amplifier=0.1,
        damping=2 / 2.0,
        eps=1e-8,
    )
    opt, got = _run_logreg(X, y, batches, x0, 20, compat="auto-tuned-FL")
    assert opt.defaults["first_step"] == "official"
    assert opt.defaults["step_eps"] == 1e-8
    np.testing.assert_allclose([h.eta for h in opt.history[0]], etas, rtol=1e-10)
    np.testing.assert_allclose(got, xs, rtol=1e-10, atol=1e-12)
    assert etas[0] == pytest.approx(0.2 * math.sqrt(1.1), rel=1e-15)


def test_compat_preset_explicit_arguments_win():
    p = torch.zeros(2, requires_grad=True)
    opt = DeltaSGD([p], compat="auto-tuned-FL", first_step="paper", step_eps=0.0)
    assert opt.defaults["first_step"] == "paper" and opt.defaults["step_eps"] == 0.0
    assert DeltaSGD([p]).defaults["first_step"] == "paper"
    assert DeltaSGD([p]).defaults["step_eps"] == 0.0


# --------------------------------- quadratic: step bounds of Alg. 1 line 9


def _quadratic_run(A, x0, steps, mode="same_batch", **kw):
    x = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    At = torch.tensor(A, dtype=torch.float64)
    opt = DeltaSGD([x], mode=mode, **kw)

    def closure():
        opt.zero_grad()
        loss = 0.5 * (At * x * x).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
    return opt, x.detach().numpy()


@pytest.mark.parametrize("gamma", [2.0, 1.0])
def test_u1_quadratic_bounds(gamma):
    A = np.array([10.0, 1.0, 0.1])
    opt, _ = _quadratic_run(A, [1.0, 1.0, 1.0], 100, gamma=gamma)
    hist = opt.history[0]
    eta0, delta = 0.2, 0.1
    lo, hi = gamma / (2 * A.max()), gamma / (2 * A.min())
    assert hist[0].eta == eta0
    finite_terms = 0
    for prev, cur in zip(hist, hist[1:], strict=False):
        assert cur.eta <= math.sqrt(1 + delta * prev.theta) * prev.eta * (1 + 1e-12)
        assert cur.eta >= min(eta0, lo) * (1 - 1e-12)
        if math.isfinite(cur.smooth_term):
            finite_terms += 1
            assert lo * (1 - 1e-12) <= cur.smooth_term <= hi * (1 + 1e-12)
    assert finite_terms > 50
    assert min(h.eta for h in hist) < 1.1 * min(eta0, lo)  # the bound is nearly tight
    # Full batch: consecutive mode sees the same gradients, hence the same η.
    opt2, _ = _quadratic_run(A, [1.0, 1.0, 1.0], 100, mode="consecutive", gamma=gamma)
    np.testing.assert_allclose(
        [h.eta for h in opt2.history[0]], [h.eta for h in hist], rtol=1e-12
    )


# --------------------------------------------- round reset (Alg. 1 line 6)


def test_u4_reset_restarts_round():
    X, y, batches, x0 = _logreg_data()
    w, b, Xt, yt = _logreg_torch(X, y, x0)
    opt = DeltaSGD([w, b])

    def closure():
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(Xt @ w + b, yt)
        loss.backward()
        return loss

    for _ in range(6):
        opt.step(closure)
    assert opt.param_groups[0]["lr"] != 0.2 and opt.state
    opt.reset()
    group = opt.param_groups[0]
    assert (group["lr"], group["theta"], group["k"]) == (0.2, 1.0, 0)
    assert not opt.state and opt.history == [[]]
    before = torch.cat([w, b]).detach().clone()
    opt.step(closure)
    g = torch.cat([w.grad, b.grad])
    torch.testing.assert_close(torch.cat([w, b]).detach(), before - 0.2 * g)
    assert opt.last_step_info[0].branch == "first"
    assert opt.last_step_info[0].eta == 0.2
    opt.reset(lr=0.05)
    assert group["lr"] == group["eta0"] == 0.05
    with pytest.raises(ValueError, match="lr"):
        opt.reset(lr=0.0)


# ---------------------------- zero denominators (our guard: growth branch)


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
def test_u5_linear_loss_takes_growth_branch(mode):
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    c = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    opt = DeltaSGD([x], mode=mode)

    def closure():
        opt.zero_grad()
        loss = (c * x).sum()
        loss.backward()
        return loss

    for _ in range(30):
        opt.step(closure)
    hist = opt.history[0]
    assert all(h.branch == "growth" for h in hist[1:])
    assert all(h.smooth_term == math.inf for h in hist[1:])
    for prev, cur in zip(hist, hist[1:], strict=False):
        assert cur.eta == pytest.approx(math.sqrt(1 + 0.1 * prev.theta) * prev.eta)
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
def test_u5_one_dim_quadratic_hits_minimiser(mode):
    # f = (L/2)x² with L = 8 and γ = 2: the first term is exactly 1/L = 0.125,
    # which jumps to the minimiser; then ‖Δx‖ = ‖Δg‖ = 0 (the guard). Powers of
    # two keep every product exact (torch may fuse x - η·g into an FMA).
    x = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    opt = DeltaSGD([x], lr=0.25, mode=mode)

    def closure():
        opt.zero_grad()
        loss = 4.0 * (x * x).sum()
        loss.backward()
        return loss

    for _ in range(8):
        opt.step(closure)
    hist = opt.history[0]
    assert [h.branch for h in hist[:4]] == [
        "first",
        "smoothness",
        "smoothness",
        "growth",
    ]
    assert hist[1].smooth_term == 0.125  # exactly γ/(2L)
    assert x.item() == 0.0
    assert all(math.isfinite(h.eta) and math.isfinite(h.theta) for h in hist)
    assert all(h.branch == "growth" for h in hist[3:])
    assert all(h.smooth_term == math.inf for h in hist[3:])


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
@pytest.mark.parametrize("bad_step", [0, 3])
def test_u5_nonfinite_gradient_raises(mode, bad_step):
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    opt = DeltaSGD([x], mode=mode)
    calls = {"n": 0}

    def closure():
        opt.zero_grad()
        factor = float("nan") if opt.param_groups[0]["k"] >= bad_step else 1.0
        calls["n"] += 1
        loss = 0.5 * factor * (x * x).sum()
        loss.backward()
        return loss

    for _ in range(bad_step):
        opt.step(closure)
    before = x.detach().clone()
    k_before = opt.param_groups[0]["k"]
    lr_before = opt.param_groups[0]["lr"]
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step(closure)
    torch.testing.assert_close(x.detach(), before, rtol=0, atol=0)
    assert opt.param_groups[0]["k"] == k_before
    assert opt.param_groups[0]["lr"] == lr_before


def test_u5_inf_gradient_without_closure_raises():
    x = torch.zeros(3, requires_grad=True)
    opt = DeltaSGD([x], mode="consecutive")
    x.grad = torch.tensor([0.0, float("inf"), 1.0])
    with pytest.raises(FloatingPointError):
        opt.step()


# -------------------------- global norms (one η per client, Alg. 1 line 9)


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
def test_u6_splitting_a_tensor_keeps_eta(mode):
    rng = np.random.default_rng(1)
    M = torch.tensor(rng.normal(size=(12, 6)) * 2, dtype=torch.float64)
    t = torch.tensor(rng.normal(size=12), dtype=torch.float64)
    w0 = rng.normal(size=6)
    batches = [torch.arange(i, i + 4) for i in range(0, 12, 4)]

    def run(split):
        if split:
            params = [
                torch.tensor(w0[:2], requires_grad=True),
                torch.tensor(w0[2:], requires_grad=True),
            ]
        else:
            params = [torch.tensor(w0, requires_grad=True)]
        opt = DeltaSGD(params, mode=mode)
        for k in range(15):
            idx = batches[k % 3]

            def closure(idx=idx):
                opt.zero_grad()
                w = torch.cat(params)
                loss = 0.5 * ((M[idx] @ w - t[idx]) ** 2).mean()
                loss.backward()
                return loss

            opt.step(closure)
        return [h.eta for h in opt.history[0]], torch.cat(params).detach()

    eta_one, w_one = run(False)
    eta_two, w_two = run(True)
    np.testing.assert_allclose(eta_two, eta_one, rtol=1e-12)
    torch.testing.assert_close(w_two, w_one, rtol=1e-12, atol=1e-14)


def test_param_groups_keep_separate_eta():
    """Two decoupled groups with per-group overrides equal two separate runs."""
    A1 = torch.tensor([4.0, 0.5], dtype=torch.float64)
    A2 = torch.tensor([1.0, 3.0, 0.2], dtype=torch.float64)

    def make():
        return (
            torch.ones(2, dtype=torch.float64, requires_grad=True),
            torch.ones(3, dtype=torch.float64, requires_grad=True),
        )

    def loss_of(p, A):
        return 0.5 * (A * p * p).sum()

    p1, p2 = make()
    joint = DeltaSGD(
        [{"params": [p1]}, {"params": [p2], "lr": 0.05, "gamma": 1.0}], delta=0.2
    )
    q1, q2 = make()
    solo1 = DeltaSGD([q1], delta=0.2)
    solo2 = DeltaSGD([q2], lr=0.05, gamma=1.0, delta=0.2)

    def closure_for(opt, pairs):
        def closure():
            opt.zero_grad()
            loss = sum(loss_of(p, A) for p, A in pairs)
            loss.backward()
            return loss

        return closure

    for _ in range(12):
        joint.step(closure_for(joint, [(p1, A1), (p2, A2)]))
        solo1.step(closure_for(solo1, [(q1, A1)]))
        solo2.step(closure_for(solo2, [(q2, A2)]))
    assert [h.eta for h in joint.history[0]] == pytest.approx(
        [h.eta for h in solo1.history[0]], rel=1e-12
    )
    assert [h.eta for h in joint.history[1]] == pytest.approx(
        [h.eta for h in solo2.history[0]], rel=1e-12
    )
    torch.testing.assert_close(p2.detach(), q2.detach())
    assert joint.param_groups[1]["eta0"] == 0.05


# ------------------------ same-batch side effects (§3 remarks: same batch)


def _mse_closure(opt, model, inputs, targets):
    """The closure ``opt.step`` takes: ``model``'s mean squared error on one
    batch, gradients cleared first."""

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss

    return closure


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)
    ).double()


def _bn_batches():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(16, 4, generator=g, dtype=torch.float64),
            torch.randn(16, 1, generator=g, dtype=torch.float64),
        )
        for _ in range(3)
    ]


def test_u7_same_batch_pass_keeps_bn_stats_and_batch():
    model = _bn_model()
    opt = DeltaSGD(model.parameters(), module=model)
    batches = _bn_batches()
    seen = []  # (step, batch id, first-layer weight) per closure call
    for k in range(6):
        inputs, targets = batches[k % 3]
        reference = copy.deepcopy(model)
        with torch.no_grad():
            reference(inputs)  # one train-mode forward at x_k: the expected stats

        def closure(inputs=inputs, targets=targets, k=k):
            seen.append((k, id(inputs), model[0].weight.detach().clone()))
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            return loss

        opt.step(closure)
        for got, want in zip(model.buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert model[1].num_batches_tracked.item() == 6
    calls = list(seen)
    per_step = [sum(1 for s in calls if s[0] == k) for k in range(6)]
    assert per_step == [1, 2, 2, 2, 2, 2]
    for k in range(1, 6):
        first, second = [s for s in calls if s[0] == k]
        assert first[1] == second[1]  # same batch object
        prev_first = [s for s in calls if s[0] == k - 1][0]
        torch.testing.assert_close(second[2], prev_first[2], rtol=0, atol=0)  # x_{k-1}


def test_u7_without_module_closure_is_responsible():
    model = _bn_model()
    opt = DeltaSGD(model.parameters())  # no module: extra pass counts in BN stats
    inputs, targets = _bn_batches()[0]

    for _ in range(3):
        opt.step(_mse_closure(opt, model, inputs, targets))
    assert model[1].num_batches_tracked.item() == 5


def test_preserve_buffers_restores_on_error():
    model = _bn_model()
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(RuntimeError, match="boom"), preserve_buffers(model):
        model(torch.randn(8, 4, dtype=torch.float64))
        raise RuntimeError("boom")
    for got, want in zip(model.buffers(), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with preserve_buffers(None):
        pass


def test_same_batch_restores_gradients_at_x_k():
    X, y, batches, x0 = _logreg_data()
    w, b, Xt, yt = _logreg_torch(X, y, x0)
    opt = DeltaSGD([w, b])

    def closure():
        opt.zero_grad(set_to_none=False)  # in-place zeroing must not hurt g(x_k)
        loss = nn.functional.binary_cross_entropy_with_logits(Xt @ w + b, yt)
        loss.backward()
        return loss

    for _ in range(4):
        x_before = torch.cat([w, b]).detach().clone()
        with torch.enable_grad():
            closure()
        g_expected = torch.cat([w.grad, b.grad]).clone()
        opt.step(closure)
        torch.testing.assert_close(torch.cat([w.grad, b.grad]), g_expected)
        eta = opt.last_step_info[0].eta
        torch.testing.assert_close(
            torch.cat([w, b]).detach(), x_before - eta * g_expected
        )


def test_consecutive_one_closure_call_per_step_and_no_closure():
    X, y, batches, x0 = _logreg_data()
    w, b, Xt, yt = _logreg_torch(X, y, x0)
    opt = DeltaSGD([w, b], mode="consecutive")
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(Xt @ w + b, yt)
        loss.backward()
        return loss

    for _ in range(5):
        assert opt.step(closure) is not None
    assert len(calls) == 5

    w2, b2, _, _ = _logreg_torch(X, y, x0)
    opt2 = DeltaSGD([w2, b2], mode="consecutive")
    for _ in range(5):  # SGD-style: gradients computed outside, step()
        opt2.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(Xt @ w2 + b2, yt).backward()
        assert opt2.step() is None
    assert [h.eta for h in opt2.history[0]] == [h.eta for h in opt.history[0]]
    torch.testing.assert_close(w2.detach(), w.detach(), rtol=0, atol=0)


def test_same_batch_requires_closure():
    x = torch.ones(2, requires_grad=True)
    opt = DeltaSGD([x])
    (x * x).sum().backward()
    with pytest.raises(ValueError, match="closure"):
        opt.step()


# ---------------------------------------------------------- hyperparameters


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": -0.1}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"gamma": 0.0}, "gamma"),
        ({"delta": -0.01}, "delta"),
        ({"theta0": -1.0}, "theta0"),
        ({"theta0": float("inf")}, "theta0"),
        ({"step_eps": -1e-8}, "step_eps"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"mode": "same-batch"}, "mode"),
        ({"first_step": "code"}, "first_step"),
        ({"compat": "adsgd"}, "compat"),
    ],
)
def test_invalid_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        DeltaSGD([torch.zeros(1, requires_grad=True)], **kwargs)


def test_invalid_group_override():
    p, q = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="Invalid gamma"):
        DeltaSGD([{"params": [p]}, {"params": [q], "gamma": -1.0}])


def test_defaults_and_stats():
    x = torch.tensor([1.0, -1.0], dtype=torch.float64, requires_grad=True)
    opt = DeltaSGD([x])
    assert opt.defaults == {
        "lr": 0.2,
        "gamma": 2.0,
        "delta": 0.1,
        "theta0": 1.0,
        "mode": "same_batch",
        "first_step": "paper",
        "step_eps": 0.0,
        "weight_decay": 0.0,
    }
    assert opt.stats()["steps"] == 0.0 and opt.stats()["eta-last"] == 0.2
    assert opt.last_step_info == [None]

    def closure():
        opt.zero_grad()
        loss = (torch.tensor([3.0, 0.5], dtype=torch.float64) * x * x).sum()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    etas = [h.eta for h in opt.history[0]]
    stats = opt.stats()
    assert stats["steps"] == 5.0
    assert stats["eta-last"] == etas[-1] == opt.param_groups[0]["lr"]
    assert stats["eta-mean"] == pytest.approx(np.mean(etas))
    assert stats["eta-min"] == min(etas) and stats["eta-max"] == max(etas)
    assert 0.0 <= stats["growth-fraction"] <= 1.0


# -------------------------------------------------------------- state dict


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
def test_state_dict_round_trip_lock_step(mode):
    X, y, batches, x0 = _logreg_data()
    wa, ba, Xt, yt = _logreg_torch(X, y, x0)
    opt_a = DeltaSGD([wa, ba], mode=mode, weight_decay=0.01)

    def make_closure(opt, w, b, k):
        return _logreg_closure(opt, w, b, Xt, yt, batches[k % len(batches)])

    for k in range(5):
        opt_a.step(make_closure(opt_a, wa, ba, k))
    saved = opt_a.state_dict()  # not deep-copied: no in-place aliasing allowed
    wb = wa.detach().clone().requires_grad_(True)
    bb = ba.detach().clone().requires_grad_(True)
    opt_b = DeltaSGD([wb, bb], mode=mode, weight_decay=0.01)
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    assert opt_b.param_groups[0]["k"] == 5
    for k in range(5, 12):
        opt_a.step(make_closure(opt_a, wa, ba, k))
        opt_b.step(make_closure(opt_b, wb, bb, k))
        assert torch.equal(wa, wb) and torch.equal(ba, bb)
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    # Resuming equals an uninterrupted reference run.
    etas, _, _, xs = _reference(
        lambda x, i: _logreg_grad(x, X, y, i), x0, batches, 12, mode=mode, wd=0.01
    )
    np.testing.assert_allclose(torch.cat([wb, bb]).detach().numpy(), xs[-1], rtol=1e-10)
    np.testing.assert_allclose([h.eta for h in opt_b.history[0]], etas[5:], rtol=1e-10)


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
def test_state_dict_is_a_snapshot_and_loading_copies(mode):
    """x_{k-1} / g_{k-1} are buffers refreshed in place, so ``state_dict``
    returns copies (it does not follow later steps) and ``load_state_dict``
    copies what it loads (two optimizers loaded from one dict stay apart)."""
    X, y, batches, x0 = _logreg_data()
    w, b, Xt, yt = _logreg_torch(X, y, x0)
    opt = DeltaSGD([w, b], mode=mode)

    def make_closure(opt, w, b, k):
        return _logreg_closure(opt, w, b, Xt, yt, batches[k % len(batches)])

    for k in range(4):
        opt.step(make_closure(opt, w, b, k))
    saved = opt.state_dict()
    frozen = copy.deepcopy(saved)
    point = [w.detach().clone(), b.detach().clone()]
    for k in range(4, 7):
        opt.step(make_closure(opt, w, b, k))
    for key, entry in frozen["state"].items():
        assert entry.keys() == saved["state"][key].keys()
        for name, value in entry.items():
            assert torch.equal(saved["state"][key][name], value)
    clones = []
    for _ in range(2):
        wc, bc = (t.clone().requires_grad_(True) for t in point)
        other = DeltaSGD([wc, bc], mode=mode)
        other.load_state_dict(saved)
        for key, entry in saved["state"].items():
            loaded = other.state[other.param_groups[0]["params"][key]]
            for name, value in entry.items():
                assert loaded[name].data_ptr() != value.data_ptr()
        clones.append((other, wc, bc))
    for k in range(4, 7):
        for other, wc, bc in clones:
            other.step(make_closure(other, wc, bc, k))
    for other, wc, bc in clones:
        assert torch.equal(wc, w) and torch.equal(bc, b)
        assert other.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_same_batch_pass_follows_reassigned_buffers():
    """The cached buffer list notices a re-assigned BatchNorm buffer."""
    model = _bn_model()
    opt = DeltaSGD(model.parameters(), module=model)
    inputs, targets = _bn_batches()[0]

    for _ in range(3):
        opt.step(_mse_closure(opt, model, inputs, targets))
    model[1].running_mean = model[1].running_mean.clone()
    model[1].num_batches_tracked = model[1].num_batches_tracked.clone()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference(inputs)  # the one train-mode pass at x_k that should count
    opt.step(_mse_closure(opt, model, inputs, targets))
    for got, want in zip(model.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert model[1].num_batches_tracked.item() == 4


# ---------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
def test_cuda_matches_cpu(mode):
    X, y, batches, x0 = _logreg_data()
    opt_cpu, xs_cpu = _run_logreg(
        X, y, batches, x0, 10, dtype=torch.float32, device="cpu", mode=mode
    )
    opt_gpu, xs_gpu = _run_logreg(
        X, y, batches, x0, 10, dtype=torch.float32, device="cuda", mode=mode
    )
    assert opt_gpu.state[opt_gpu.param_groups[0]["params"][0]]["prev_param"].is_cuda
    np.testing.assert_allclose(
        [h.eta for h in opt_gpu.history[0]],
        [h.eta for h in opt_cpu.history[0]],
        rtol=1e-5,
    )
    np.testing.assert_allclose(xs_gpu, xs_cpu, rtol=1e-5, atol=1e-6)


# ------------------------------------------- functional form and both paths


def _mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh()).to(
        torch.float32
    )


def _spy_paths(monkeypatch):
    """Count which implementation each step of every group went through."""
    calls = []
    for name in ("_single_tensor_delta_sgd", "_multi_tensor_delta_sgd"):
        kernels = getattr(deltasgd, name)

        def norms(*args, _kernels=kernels, _name=name, **kwargs):
            calls.append(_name)
            return _kernels.norms(*args, **kwargs)

        monkeypatch.setattr(deltasgd, name, kernels._replace(norms=norms))
    return calls


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_single_tensor_and_foreach_paths_agree(monkeypatch, mode, wd):
    calls = _spy_paths(monkeypatch)
    g = torch.Generator().manual_seed(4)
    batches = [
        (torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g))
        for _ in range(3)
    ]
    runs = {}
    for foreach in (False, True):
        model = _mlp()
        opt = DeltaSGD(
            model.parameters(), mode=mode, weight_decay=wd, foreach=foreach, lr=2.0
        )
        weights = []
        for k in range(12):
            inputs, targets = batches[k % 3]
            opt.step(_mse_closure(opt, model, inputs, targets))
            weights.append([p.detach().clone() for p in model.parameters()])
        runs[foreach] = (opt.history[0], weights, opt.state_dict())
    assert calls == ["_single_tensor_delta_sgd"] * 12 + ["_multi_tensor_delta_sgd"] * 12
    (hist_a, w_a, sd_a), (hist_b, w_b, sd_b) = runs[False], runs[True]
    assert [h.branch for h in hist_a] == [h.branch for h in hist_b]
    assert "smoothness" in {h.branch for h in hist_a}  # the norms set η
    np.testing.assert_allclose(
        [h.eta for h in hist_a], [h.eta for h in hist_b], rtol=1e-6
    )
    for step_a, step_b in zip(w_a, w_b, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(a, b)
    for key, entry in sd_a["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(value, sd_b["state"][key][name])


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
@pytest.mark.parametrize("first_step", ["paper", "official"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_functional_delta_sgd_matches_numpy_reference(foreach, mode, first_step, wd):
    """``delta_sgd`` driven by hand, step by step, equals the float64 oracle."""
    X, y, batches, x0 = _logreg_data()
    d = X.shape[1]

    def grad(x, idx):
        return _logreg_grad(x, X, y, idx)

    etas, thetas, branches, xs = _reference(
        grad, x0, batches, 20, mode=mode, first_step=first_step, wd=wd
    )
    # Two tensors (w, b), so the global norms combine several tensors.
    params = [torch.tensor(x0[:d]), torch.tensor(x0[d:])]
    prev_params = [torch.empty_like(p) for p in params]
    prev_grads = [torch.empty_like(p) for p in params]
    lr, theta = 0.2, 1.0
    x_prev = None
    infos, got = [], []
    for k in range(20):
        idx = batches[k % len(batches)]
        x = torch.cat(params).numpy().copy()
        g = grad(x, idx)
        grads = [torch.tensor(g[:d]), torch.tensor(g[d:])]
        if mode == "same_batch" and k > 0:
            h = grad(x_prev, idx)  # g̃_{B_k}(x_{k-1})
            prev_grads = [torch.tensor(h[:d]), torch.tensor(h[d:])]
        info = delta_sgd(
            params,
            grads,
            prev_params,
            prev_grads,
            step=k,
            lr=lr,
            theta=theta,
            first_step=first_step,
            weight_decay=wd,
            foreach=foreach,
        )
        np.testing.assert_array_equal(torch.cat(prev_params).numpy(), x)  # kept x_k
        lr, theta, x_prev = info.eta, info.theta, x
        infos.append(info)
        got.append(torch.cat(params).numpy().copy())
    np.testing.assert_allclose([i.eta for i in infos], etas, rtol=1e-10)
    np.testing.assert_allclose([i.theta for i in infos], thetas, rtol=1e-10)
    assert [i.branch for i in infos] == branches
    assert [i.step for i in infos] == list(range(20))
    np.testing.assert_allclose(got, xs, rtol=1e-10, atol=1e-12)


def test_step_size_rule_closed_form():
    """The rule on host floats: line 6, both terms of line 9, guard, eps."""
    kw = {"gamma": 2.0, "delta": 0.5}
    assert step_size([3.0], step=0, lr=0.2, theta=1.0, **kw) == (
        0,
        0.2,
        1.0,
        "first",
        pytest.approx(math.nan, nan_ok=True),
    )
    first = step_size([3.0], step=0, lr=0.2, theta=1.0, first_step="official", **kw)
    assert first.eta == 0.2 * math.sqrt(1.5) and first.theta == math.sqrt(1.5)
    # γ‖Δx‖/(2‖Δg‖) = 2·1/(2·8) = 0.125 < sqrt(1 + 0.5·2)·0.1 ≈ 0.141
    info = step_size([1.0, 8.0], step=3, lr=0.1, theta=2.0, step_eps=1e-3, **kw)
    assert info == (3, 0.125 + 1e-3, (0.125 + 1e-3) / 0.1, "smoothness", 0.125)
    info = step_size([1.0, 2.0], step=3, lr=0.1, theta=2.0, step_eps=1e-3, **kw)
    assert info.branch == "growth" and info.smooth_term == 0.5
    assert info.eta == math.sqrt(2.0) * 0.1 + 1e-3
    for norms in ([0.0, 2.0], [1.0, 0.0], [0.0, 0.0]):
        info = step_size(norms, step=1, lr=0.1, theta=2.0, step_eps=1e-3, **kw)
        assert (info.eta, info.branch, info.smooth_term) == (
            math.sqrt(2.0) * 0.1,
            "growth",
            math.inf,
        )
    for norms in ([math.nan, 1.0], [1.0, math.inf]):
        with pytest.raises(FloatingPointError, match="non-finite"):
            step_size(norms, step=1, lr=0.1, theta=1.0, **kw)
    with pytest.raises(FloatingPointError, match="non-finite"):
        step_size([math.inf], step=0, lr=0.1, theta=1.0, **kw)


def test_nonfinite_in_second_group_leaves_first_group_unchanged():
    """All groups' norms are checked before any group moves."""
    p = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)
    opt = DeltaSGD([{"params": [p]}, {"params": [q]}], mode="consecutive")
    p.grad = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q.grad = torch.tensor([float("nan")], dtype=torch.float64)
    with pytest.raises(FloatingPointError, match="param group 1"):
        opt.step()
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert [g["k"] for g in opt.param_groups] == [0, 0] and not opt.state


def test_foreach_argument():
    p = torch.zeros(2, requires_grad=True)
    assert "foreach" not in DeltaSGD([p], foreach=False).defaults
    with pytest.raises(ValueError, match="Invalid foreach"):
        DeltaSGD([p], foreach="yes")


def test_default_path_is_foreach_for_plain_tensors(monkeypatch):
    class Marked(torch.Tensor):
        pass

    assert deltasgd._default_foreach([torch.zeros(3), nn.Parameter(torch.zeros(2))])
    assert not deltasgd._default_foreach([torch.zeros(3).as_subclass(Marked)])
    calls = _spy_paths(monkeypatch)
    x = torch.ones(3, requires_grad=True)
    opt = DeltaSGD([x], mode="consecutive")
    for _ in range(2):
        x.grad = torch.ones(3)
        opt.step()
    assert calls == ["_multi_tensor_delta_sgd"] * 2


# ------------------------------- step() is the functional; foreach per group


def _mse_batches(n=3):
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g))
        for _ in range(n)
    ]


def _grads_at(model, inputs, targets):
    """g̃(x) of ``model``'s current parameters on one batch (fresh tensors)."""
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(inputs), targets).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_step_and_functional_give_identical_trajectories(foreach, mode, wd):
    """``DeltaSGD.step`` equals ``delta_sgd`` driven by hand, bit for bit."""
    batches = _mse_batches()
    model = _mlp()
    opt = DeltaSGD(
        model.parameters(), lr=2.0, mode=mode, weight_decay=wd, foreach=foreach
    )
    # By hand: x_k in ``ref``; the same-batch gradient at x_{k-1} from ``back``.
    ref, back = _mlp(), _mlp()
    params = list(ref.parameters())
    prev_params = [torch.empty_like(p) for p in params]
    prev_grads = [torch.empty_like(p) for p in params]
    lr, theta = 2.0, 1.0
    for k in range(15):
        inputs, targets = batches[k % len(batches)]
        opt.step(_mse_closure(opt, model, inputs, targets))

        grads = _grads_at(ref, inputs, targets)
        if mode == "same_batch" and k > 0:
            with torch.no_grad():
                for q, x_prev in zip(back.parameters(), prev_params, strict=True):
                    q.copy_(x_prev)
            prev_grads = _grads_at(back, inputs, targets)
        with torch.no_grad():
            info = delta_sgd(
                params,
                grads,
                prev_params,
                prev_grads,
                step=k,
                lr=lr,
                theta=theta,
                weight_decay=wd,
                foreach=foreach,
            )
        lr, theta = info.eta, info.theta
        got = opt.history[0][-1]
        assert got[:4] == info[:4]  # step, η, θ, branch: equal floats
        assert got.smooth_term == info.smooth_term or k == 0  # NaN at k = 0
        for p, q in zip(model.parameters(), params, strict=True):
            assert torch.equal(p.detach(), q.detach())
    assert "smoothness" in {h.branch for h in opt.history[0]}  # the norms set η


def _spy_both_paths(monkeypatch):
    """Record the path of each group's norms and update, in call order."""
    calls = []
    for name in ("_single_tensor_delta_sgd", "_multi_tensor_delta_sgd"):
        kernels = getattr(deltasgd, name)
        path = name.split("_")[1]  # "single" / "multi"

        def norms(*args, _k=kernels, _p=path, **kwargs):
            calls.append(("norms", _p, len(args[0])))
            return _k.norms(*args, **kwargs)

        def update(*args, _k=kernels, _p=path, **kwargs):
            calls.append(("update", _p, len(args[0])))
            return _k.update(*args, **kwargs)

        monkeypatch.setattr(deltasgd, name, deltasgd._Kernels(norms, update))
    return calls


@pytest.mark.parametrize("mode", ["same_batch", "consecutive"])
def test_group_level_foreach_is_honoured(monkeypatch, mode):
    """``foreach`` is a group option; the constructor's is the groups' default."""
    calls = _spy_both_paths(monkeypatch)
    model = _mlp()
    first, *rest = model.parameters()  # 1 tensor, then 3
    opt = DeltaSGD(
        [{"params": [first], "foreach": False}, {"params": rest}],
        lr=2.0,
        mode=mode,
        foreach=True,
    )
    inputs, targets = _mse_batches(1)[0]

    for _ in range(3):
        opt.step(_mse_closure(opt, model, inputs, targets))
    # Both groups' norms (one host read), then both updates, every step.
    step = [
        ("norms", "single", 1),
        ("norms", "multi", 3),
        ("update", "single", 1),
        ("update", "multi", 3),
    ]
    assert calls == step * 3
    assert [g["foreach"] for g in opt.param_groups] == [False, True]
    # A group option survives state_dict; a bad one is rejected.
    first2, *rest2 = _mlp().parameters()
    clone = DeltaSGD([{"params": [first2]}, {"params": rest2}], mode=mode)
    assert [g["foreach"] for g in clone.param_groups] == [None, None]
    clone.load_state_dict(opt.state_dict())
    assert [g["foreach"] for g in clone.param_groups] == [False, True]
    with pytest.raises(ValueError, match="Invalid foreach"):
        DeltaSGD([{"params": [first2], "foreach": 1}])


def test_default_foreach_is_one_policy_shared_with_fedlamb(monkeypatch):
    """``foreach=None``: Fed-LAMB's policy, so large CPU tensors loop."""
    from fedadapt.optimizers import fedlamb

    assert deltasgd._default_foreach is fedlamb._default_foreach
    calls = _spy_both_paths(monkeypatch)
    big = torch.zeros(300, 300, requires_grad=True)  # 90,000 > 32,768 elements
    small = torch.zeros(3, requires_grad=True)
    opt = DeltaSGD([{"params": [big]}, {"params": [small]}], mode="consecutive")
    big.grad, small.grad = torch.ones(300, 300), torch.ones(3)
    opt.step()
    assert [c[1] for c in calls] == ["single", "multi", "single", "multi"]


def test_functional_norms_argument_and_missing_previous_iterate():
    """``norms=`` skips the device norms; without them ``prev_*`` are needed."""
    params = [torch.tensor([1.0, -2.0], dtype=torch.float64)]
    grads = [torch.tensor([0.5, 0.25], dtype=torch.float64)]
    prev = [torch.tensor([1.5, -1.0], dtype=torch.float64)]
    prev_g = [torch.tensor([0.0, 1.0], dtype=torch.float64)]
    norms = deltasgd.delta_sgd_norms(params, grads, prev, prev_g, step=3).tolist()
    assert norms == [math.hypot(0.5, 1.0), math.hypot(0.5, 0.75)]
    kw = {"step": 3, "lr": 0.1, "theta": 2.0}
    a = [p.clone() for p in params]
    info_a = delta_sgd(
        a, grads, [q.clone() for q in prev], [h.clone() for h in prev_g], **kw
    )
    b = [p.clone() for p in params]
    info_b = delta_sgd(b, grads, None, None, norms=norms, **kw)
    assert info_a[:4] == info_b[:4] and torch.equal(a[0], b[0])
    assert torch.equal(b[0], params[0] - info_b.eta * grads[0])
    with pytest.raises(ValueError, match="prev_params and prev_grads"):
        delta_sgd([p.clone() for p in params], grads, None, None, **kw)
