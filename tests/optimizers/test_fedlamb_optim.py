"""Fed-LAMB / Fed-AMS client optimizers (arXiv:2110.00532 Algorithm 1).

The oracle is a float64 NumPy transcription of the client step written below
(``_Reference``, Algorithm 1 as read in ``fedadapt.optimizers.fedlamb``),
never the code under test; the round-one Fed-AMS check also uses torch's Adam.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from fedadapt.optimizers import fedlamb
from fedadapt.optimizers.fedlamb import FedAMS, FedLAMB

# One weight matrix, a zero-initialised bias (zero-norm guard), a second matrix.
SHAPES = [(3, 4), (3,), (2, 3)]


def _problem(seed, zero_bias=True):
    """Initial params, curvatures a, targets c and per-step noise s_t.

    Loss f(θ) = Σ_k Σ ½ a_k (θ_k − c_k)² + s_{t,k}·θ_k, so the stochastic
    gradient is a_k (θ_k − c_k) + s_{t,k} (written out again in NumPy).
    """
    rng = np.random.default_rng(seed)
    init = [rng.normal(size=s) for s in SHAPES]
    if zero_bias:
        init[1][:] = 0.0
    a = [rng.uniform(0.5, 2.0, size=s) for s in SHAPES]
    c = [rng.normal(size=s) for s in SHAPES]
    noise = rng.normal(scale=0.5, size=(64, sum(math.prod(s) for s in SHAPES)))
    return init, a, c, noise


def _split(row):
    out, i = [], 0
    for s in SHAPES:
        n = math.prod(s)
        out.append(row[i : i + n].reshape(s))
        i += n
    return out


def _np_grads(theta, a, c, noise_row, scale=1.0):
    s = _split(noise_row)
    return [
        scale * (ak * (th - ck) + sk)
        for th, ak, ck, sk in zip(theta, a, c, s, strict=True)
    ]


def _torch_step(opt, params, a, c, noise_row, scale=1.0):
    opt.zero_grad(set_to_none=True)
    s = _split(noise_row)
    loss = sum(
        (0.5 * torch.as_tensor(ak) * (p - torch.as_tensor(ck)) ** 2).sum()
        + (torch.as_tensor(sk) * p).sum()
        for p, ak, ck, sk in zip(params, a, c, s, strict=True)
    )
    (scale * loss).backward()
    opt.step()


class _Reference:
    """The client in float64 NumPy (LAMB Algorithm 1 lines 4-12, as read)."""

    def __init__(self, theta, v_hat, *, lr, b1, b2, eps, lam, trust, bc_m, bc_v, phi):
        self.theta = [t.copy() for t in theta]
        self.m = [np.zeros_like(t) for t in theta]
        self.v = [v.copy() for v in v_hat]
        self.vmax = [v.copy() for v in v_hat]
        self.t = 0
        self.kw = dict(lr=lr, b1=b1, b2=b2, eps=eps, lam=lam, trust=trust)
        self.bc_m, self.bc_v, self.phi = bc_m, bc_v, phi

    def step(self, grads):
        k = self.kw
        self.t += 1
        t = self.t
        for i, g in enumerate(grads):
            self.m[i] = k["b1"] * self.m[i] + (1 - k["b1"]) * g
            self.v[i] = k["b2"] * self.v[i] + (1 - k["b2"]) * g * g
            self.vmax[i] = np.maximum(self.vmax[i], self.v[i])
            m_hat = self.m[i] / (1 - k["b1"] ** t) if self.bc_m else self.m[i]
            vmax = self.vmax[i] / (1 - k["b2"] ** t) if self.bc_v else self.vmax[i]
            p = m_hat / (np.sqrt(vmax) + k["eps"])
            if not k["trust"]:
                self.theta[i] = self.theta[i] - k["lr"] * p
                continue
            u = p + k["lam"] * self.theta[i]
            w_n = np.sqrt(np.sum(self.theta[i] ** 2))
            u_n = np.sqrt(np.sum(u**2))
            phi = w_n if self.phi is None else min(max(w_n, self.phi[0]), self.phi[1])
            r = phi / u_n if (w_n > 0 and u_n > 0) else 1.0
            self.theta[i] = self.theta[i] - k["lr"] * r * u


def _make(cls_kwargs, params):
    cls, kwargs = cls_kwargs
    return cls(params, **kwargs)


CONFIGS = {
    "fedams": (FedAMS, dict(lr=0.05)),
    "fedams-bcv": (FedAMS, dict(lr=0.05, bias_correction_v=True)),
    "fedams-nobcm": (FedAMS, dict(lr=0.05, bias_correction_m=False)),
    "fedlamb": (FedLAMB, dict(lr=0.02)),
    "fedlamb-lam0.1-clip": (
        FedLAMB,
        dict(lr=0.02, weight_decay=0.1, phi_bounds=(1.0, 2.5)),
    ),
    "fedlamb-lam0-bcv": (
        FedLAMB,
        dict(lr=0.02, weight_decay=0.0, bias_correction_v=True),
    ),
}


def _reference_kwargs(cls, kwargs):
    b1, b2 = kwargs.get("betas", (0.9, 0.999))
    return dict(
        lr=kwargs["lr"],
        b1=b1,
        b2=b2,
        eps=kwargs.get("eps", 1e-8),
        lam=kwargs.get("weight_decay", 0.01) if cls is FedLAMB else 0.0,
        trust=cls is FedLAMB,
        bc_m=kwargs.get("bias_correction_m", True),
        bc_v=kwargs.get("bias_correction_v", False),
        phi=kwargs.get("phi_bounds"),
    )


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_numpy_reference_over_rounds(name, foreach):
    """2 clients × 3 rounds × 5 steps, server v̂ in between (LAMB Algorithm 1)."""
    cls, kwargs = CONFIGS[name]
    kwargs = dict(kwargs, foreach=foreach)
    init, a, c, noise = _problem(0)
    ref_kw = _reference_kwargs(cls, kwargs)
    theta_bar = init
    v_hat = [np.full(s, ref_kw["eps"]) for s in SHAPES]  # LAMB Alg. 1 line 2
    load = None  # round 1: the optimizer's own v̂_0 = ε·1
    row = 0
    for _ in range(3):
        thetas, vs = [], []
        for client in range(2):
            params = [torch.tensor(t, requires_grad=True) for t in theta_bar]
            opt = cls(params, **kwargs)
            opt.load_second_moments(load)
            ref = _Reference(theta_bar, v_hat, **ref_kw)
            for _ in range(5):
                noise_row = noise[row + client]
                ref.step(_np_grads(ref.theta, a, c, noise_row))
                _torch_step(opt, params, a, c, noise_row)
                for p, expected in zip(params, ref.theta, strict=True):
                    np.testing.assert_allclose(
                        p.detach().numpy(), expected, rtol=1e-10, atol=1e-12
                    )
                row += 2
            sent = opt.second_moments()
            for got, expected in zip(sent, ref.v, strict=True):
                np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10)
            thetas.append(ref.theta)
            vs.append(ref.v)
        # Server, by hand: uniform means and the elementwise max.
        theta_bar = [(x + y) / 2 for x, y in zip(*thetas, strict=True)]
        v_hat = [
            np.maximum(vh, (x + y) / 2) for vh, x, y in zip(v_hat, *vs, strict=True)
        ]
        load = [torch.tensor(v) for v in v_hat]


def test_trust_ratio_hand_computation():
    """LAMB Alg. 1 line 12 on one step, numbers by hand."""
    # θ = [3, 4] (‖θ‖ = 5); g = [1, −2]; β2 = 0, v̂_0 = 0, ε = 0, t = 1.
    # m̂ = g; v = g²; p = g/|g| = [1, −1]; λ = 0.5: u = [2.5, 1]; ‖u‖ = √7.25.
    theta = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    opt = FedLAMB([theta], lr=0.1, betas=(0.9, 0.0), eps=0.0, weight_decay=0.5)
    theta.grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    opt.step()
    u = np.array([2.5, 1.0])
    r = 5.0 / math.sqrt(7.25)
    np.testing.assert_allclose(
        theta.detach().numpy(), [3.0, 4.0] - 0.1 * r * u, rtol=1e-14
    )
    # With φ clipped to [1, 2]: r = 2/‖u‖.
    theta2 = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    opt2 = FedLAMB(
        [theta2], lr=0.1, betas=(0.9, 0.0), eps=0.0, weight_decay=0.5, phi_bounds=(1, 2)
    )
    theta2.grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    opt2.step()
    np.testing.assert_allclose(
        theta2.detach().numpy(),
        [3.0, 4.0] - 0.1 * (2.0 / math.sqrt(7.25)) * u,
        rtol=1e-14,
    )


def _u9_run(v_hat0, grad_fn, steps=20):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    twin = copy.deepcopy(model)
    ours = FedAMS(model.parameters(), lr=1e-2, eps=1e-8, bias_correction_v=True)
    ours.load_second_moments(v_hat0(list(model.parameters())))
    adam = torch.optim.Adam(twin.parameters(), lr=1e-2, eps=1e-8, amsgrad=True)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(8, 5, generator=gen)
        y = torch.randn(8, 3, generator=gen)
        for m, opt in ((model, ours), (twin, adam)):
            opt.zero_grad()
            grad_fn(m, x, y)
            opt.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            worst = max(worst, (p - q).abs().max().item())
    return worst


def _mse_grads(model, x, y):
    torch.nn.functional.mse_loss(model(x), y).backward()


def _large_grads(model, x, y):
    # |g| >= 1 elementwise: sign(z)·(1 + |z|) with z the MSE gradient.
    _mse_grads(model, x, y)
    for p in model.parameters():
        p.grad = torch.where(p.grad >= 0, 1.0, -1.0) * (1.0 + p.grad.abs())


def test_u9_round_one_equals_torch_adam_amsgrad():
    """Fed-AMS, round 1, one client, bias_correction_v=True vs Adam(amsgrad=True).

    With v̂_0 = 0 the two are the same arithmetic (equal to float rounding).
    With v̂_0 = ε·1 (LAMB Alg. 1 line 2) the first denominators differ by a
    relative ≈ ε/((1−β2)·g²) = 1e-5/g², so a 1e-6 tolerance holds only for
    |g| ≫ sqrt(ε/(1−β2)) ≈ 3e-3: checked here with |g| >= 1 (with small MSE
    gradients of ~1e-2 the gap is ~5e-4 after one step at lr = 1e-2).
    """
    zeros = _u9_run(lambda ps: [torch.zeros_like(p) for p in ps], _mse_grads)
    assert zeros <= 1e-6
    eps_floor = _u9_run(lambda ps: None, _large_grads)
    assert eps_floor <= 1e-6


def _force_unit_ratio(w_norm, u_norm, phi_bounds):
    return torch.ones_like(w_norm)


@pytest.mark.parametrize("foreach", [False, True])
def test_u8_unit_ratio_and_zero_lambda_is_fedams(monkeypatch, foreach):
    """r_ℓ ≡ 1 with λ = 0 makes Fed-LAMB identical to Fed-AMS.

    LAMB Alg. 1 line 12 then reduces to the plain AMSGrad step θ ← θ − α·p,
    our reading of the Local AMSGrad baseline (LAMB §1, §4), never written out.
    """
    monkeypatch.setattr(fedlamb, "_trust_ratios", _force_unit_ratio)
    init, a, c, noise = _problem(3)
    p1 = [torch.tensor(t, requires_grad=True) for t in init]
    p2 = [torch.tensor(t, requires_grad=True) for t in init]
    lamb = FedLAMB(p1, lr=0.01, weight_decay=0.0, foreach=foreach)
    ams = FedAMS(p2, lr=0.01, foreach=foreach)
    for t in range(12):
        _torch_step(lamb, p1, a, c, noise[t])
        _torch_step(ams, p2, a, c, noise[t])
        for x, y in zip(p1, p2, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("phi_bounds", [None, (1.2, 2.0)])
@pytest.mark.parametrize("foreach", [False, True])
def test_u10_step_length(phi_bounds, foreach):
    """LAMB Alg. 1 line 12: λ = 0 gives ‖Δθ^ℓ‖ = α·φ(‖θ^ℓ‖)."""
    init, a, c, noise = _problem(4, zero_bias=False)
    params = [torch.tensor(t, requires_grad=True) for t in init]
    lr = 0.03
    opt = FedLAMB(
        params, lr=lr, weight_decay=0.0, phi_bounds=phi_bounds, foreach=foreach
    )
    clipped = set()
    for t in range(12):
        before = [p.detach().clone() for p in params]
        _torch_step(opt, params, a, c, noise[t])
        for p, b in zip(params, before, strict=True):
            w = torch.linalg.vector_norm(b).item()
            phi = w if phi_bounds is None else min(max(w, phi_bounds[0]), phi_bounds[1])
            clipped.add(phi != w)
            step = torch.linalg.vector_norm(p.detach() - b).item()
            assert step == pytest.approx(lr * phi, rel=1e-10)
    if phi_bounds is not None:
        assert clipped == {True, False}  # both regimes were exercised


@pytest.mark.parametrize("cls", [FedLAMB, FedAMS])
@pytest.mark.parametrize("foreach", [False, True])
def test_u11_zero_tensors_move_without_nan(cls, foreach):
    """Zero-norm guard: a zero-initialised bias moves; nothing becomes NaN.

    Our choice: LAMB Alg. 1 line 12 with φ = identity (LAMB §4) would never move
    a zero tensor, so the trust ratio is 1 there. A zero tensor with zero grad
    stays put.
    """
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    idle = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = cls([weight, bias, idle], lr=0.01, foreach=foreach)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(5, 4, dtype=torch.float64)
        loss = ((x @ weight.T + bias - 1.0) ** 2).sum() + (idle * 0.0).sum()
        loss.backward()
        opt.step()
        for p in (weight, bias, idle):
            assert torch.isfinite(p).all()
    assert (bias != 0).all()
    assert (idle == 0).all()


@pytest.mark.parametrize("cls", [FedLAMB, FedAMS])
def test_u11_loss_scale_invariance(cls):
    """ε = 0, λ = 0: scaling the loss by c > 0 leaves the trajectory.

    The ratio p = m/(√v̂ + ε) of LAMB Alg. 1 is scale-free when ε = 0.
    """
    init, a, c, noise = _problem(5)
    runs = []
    for scale in (1.0, 0.01, 100.0):
        params = [torch.tensor(t, requires_grad=True) for t in init]
        kwargs = dict(lr=0.02, eps=0.0)
        if cls is FedLAMB:
            kwargs["weight_decay"] = 0.0
        opt = cls(params, **kwargs)
        for t in range(10):
            _torch_step(opt, params, a, c, noise[t], scale=scale)
        runs.append([p.detach() for p in params])
    for other in runs[1:]:
        for x, y in zip(runs[0], other, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def _mixed_groups(seed):
    gen = torch.Generator().manual_seed(seed)
    g64 = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(2)]
    g32 = [
        torch.randn(5, generator=gen),
        torch.zeros(7),
        torch.randn(2, 2, generator=gen),
        torch.randn(3, generator=gen, dtype=torch.float64),  # mixed dtypes
    ]
    return [p.requires_grad_() for p in g64], [p.requires_grad_() for p in g32]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_foreach_matches_forloop(name):
    cls, kwargs = CONFIGS[name]
    runs = []
    for foreach in (False, True):
        g64, g32 = _mixed_groups(7)
        opt = cls(
            [{"params": g64}, {"params": g32, "lr": kwargs["lr"] / 2}],
            **dict(kwargs, foreach=foreach),
        )
        opt.load_second_moments(None)
        gen = torch.Generator().manual_seed(8)
        for t in range(10):
            for p in g64 + g32:
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            g32[2].grad = None if t % 3 == 0 else g32[2].grad  # sometimes no grad
            opt.step()
        runs.append((g64 + g32, opt))
    (params_a, opt_a), (params_b, opt_b) = runs
    for x, y in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(x, y)
    for x, y in zip(params_a, params_b, strict=True):
        sa, sb = opt_a.state[x], opt_b.state[y]
        assert sa["step"].item() == sb["step"].item()
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            torch.testing.assert_close(sa[key], sb[key])


@pytest.mark.parametrize("cls", [FedLAMB, FedAMS])
def test_state_dict_lockstep_replay(cls):
    init, a, c, noise = _problem(6)
    p1 = [torch.tensor(t, requires_grad=True) for t in init]
    opt1 = cls(p1, lr=0.01)
    opt1.load_second_moments([torch.full(s, 1e-4, dtype=torch.float64) for s in SHAPES])
    for t in range(3):
        _torch_step(opt1, p1, a, c, noise[t])
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    opt2 = cls(p2, lr=0.5)  # hyperparameters come from the state dict
    opt2.load_state_dict(copy.deepcopy(opt1.state_dict()))
    assert opt2.param_groups[0]["lr"] == 0.01
    for t in range(3, 10):
        _torch_step(opt1, p1, a, c, noise[t])
        _torch_step(opt2, p2, a, c, noise[t])
        for x, y in zip(p1, p2, strict=True):
            assert torch.equal(x, y)
    for x, y in zip(opt1.second_moments(), opt2.second_moments(), strict=True):
        assert torch.equal(x, y)


def test_round_protocol_state():
    """Client side: round r+1 starts from v = v̂_loc = v̂_r, m = 0, t = 0.

    LAMB Alg. 1 line 6 starts v at the server's v̂; the local max v̂_loc and the
    reset of m and t are our reading (the paper does not say how m starts).
    """
    params = [torch.randn(3, 2, requires_grad=True), torch.randn(4, requires_grad=True)]
    opt = FedLAMB(params, eps=1e-6)
    # Nothing loaded yet: v̂_0 = ε·1 (LAMB Alg. 1 line 2).
    for v in opt.second_moments():
        assert torch.equal(v, torch.full_like(v, 1e-6))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    v_hat = [torch.rand(3, 2) + 1.0, torch.rand(4) + 1.0]
    opt.load_second_moments(v_hat)
    for p, v in zip(params, v_hat, strict=True):
        state = opt.state[p]
        assert state["step"].item() == 0
        assert torch.equal(state["exp_avg"], torch.zeros_like(p))
        assert torch.equal(state["exp_avg_sq"], v)
        assert torch.equal(state["max_exp_avg_sq"], v)
        assert state["exp_avg_sq"] is not v
    sent = opt.second_moments()
    sent[0].zero_()  # a copy: the state is untouched
    assert torch.equal(opt.state[params[0]]["exp_avg_sq"], v_hat[0])
    # Small gradients: v decays below v̂_loc, and the raw v is what is sent
    # (LAMB Algorithm 1 line 13 and Fig. 1 send v).
    grads = [torch.full_like(p, 0.01) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    for p, v, g, out in zip(params, v_hat, grads, opt.second_moments(), strict=True):
        expected = 0.999 * v + 0.001 * g * g
        torch.testing.assert_close(out, expected)
        assert (out < opt.state[p]["max_exp_avg_sq"]).all()
        assert opt.state[p]["step"].item() == 1
    # None starts a round from v̂_0 = ε·1 again; NumPy arrays are accepted.
    opt.load_second_moments(None)
    for v in opt.second_moments():
        assert torch.equal(v, torch.full_like(v, 1e-6))
    opt.load_second_moments([np.ones((3, 2)), np.ones(4)])
    assert opt.state[params[1]]["exp_avg_sq"].dtype == torch.float32


def test_fresh_optimizer_round_with_server_vhat_from_aggregator():
    """LAMB Alg. 1 lines 13-16 end to end: server v̂ (NumPy) feeds the next round."""
    from fedadapt.strategies.core import aggregate_second_moments

    model = torch.nn.Linear(3, 2)
    names = [n for n, _ in model.named_parameters()]
    sent = []
    for seed in (0, 1):
        client = copy.deepcopy(model)
        opt = FedAMS(client.parameters())
        opt.load_second_moments(None)
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        client(x).pow(2).sum().backward()
        opt.step()
        sent.append(
            {n: v.numpy() for n, v in zip(names, opt.second_moments(), strict=True)}
        )
    v_hat = aggregate_second_moments(None, sent)
    opt = FedAMS(model.parameters())
    opt.load_second_moments([torch.from_numpy(v_hat[n]) for n in names])
    for p, n in zip(model.parameters(), names, strict=True):
        np.testing.assert_array_equal(opt.state[p]["max_exp_avg_sq"].numpy(), v_hat[n])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("count", "Invalid v_hat: got 1 tensors for 2"),
        ("shape", r"Invalid v_hat\[1\]: shape"),
        ("nan", r"Invalid v_hat\[0\]: values must be finite"),
        ("negative", r"Invalid v_hat\[1\]: values must be >= 0"),
    ],
)
def test_load_second_moments_rejects_bad_input(bad, match):
    params = [torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)]
    opt = FedAMS(params)
    opt.load_second_moments([torch.ones(3), torch.ones(2)])
    values = {
        "count": [torch.ones(3)],
        "shape": [torch.ones(3), torch.ones(3)],
        "nan": [torch.tensor([1.0, float("nan"), 1.0]), torch.ones(2)],
        "negative": [torch.ones(3), torch.tensor([1.0, -1.0])],
    }[bad]
    with pytest.raises(ValueError, match=match):
        opt.load_second_moments(values)
    # Validation happens before any state changes.
    assert torch.equal(opt.state[params[0]]["exp_avg_sq"], torch.ones(3))


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (FedLAMB, {"lr": -1.0}, "Invalid lr: -1.0"),
        (FedAMS, {"lr": float("nan")}, "Invalid lr"),
        (FedLAMB, {"betas": (1.0, 0.999)}, "Invalid beta_1: 1.0"),
        (FedAMS, {"betas": (-0.1, 0.999)}, "Invalid beta_1: -0.1"),
        (FedAMS, {"betas": (0.9, 1.0)}, "Invalid beta_2: 1.0"),
        (FedLAMB, {"betas": (0.9,)}, "Invalid betas"),
        (FedLAMB, {"eps": -1e-8}, "Invalid eps"),
        (FedLAMB, {"weight_decay": -0.01}, "Invalid weight_decay: -0.01"),
        (FedLAMB, {"phi_bounds": (2.0, 1.0)}, "Invalid phi_bounds"),
        (FedLAMB, {"phi_bounds": (-1.0, 1.0)}, r"Invalid phi_bounds\[0\]"),
        (FedLAMB, {"phi_bounds": (0.0, 0.0)}, r"Invalid phi_bounds\[1\]"),
        (FedLAMB, {"phi_bounds": 1.0}, "Invalid phi_bounds"),
        (FedLAMB, {"bias_correction_m": "yes"}, "Invalid bias_correction_m"),
        (FedAMS, {"bias_correction_v": 1}, "Invalid bias_correction_v"),
        (FedAMS, {"foreach": "auto"}, "Invalid foreach"),
    ],
)
def test_invalid_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.zeros(2, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("cls", [FedLAMB, FedAMS])
def test_closure_and_params_without_grad(cls):
    p = torch.tensor([1.0, -2.0], requires_grad=True)
    unused = torch.tensor([3.0], requires_grad=True)
    opt = cls([p, unused], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(5.0)
    assert p.grad is not None and not torch.equal(p.detach(), torch.tensor([1.0, -2.0]))
    assert len(opt.state[unused]) == 0
    assert torch.equal(unused.detach(), torch.tensor([3.0]))
    assert opt.step() is None


def test_default_foreach_path(monkeypatch):
    """``foreach=None``: foreach for small CPU tensors, for-loop for large."""
    assert fedlamb._default_foreach([torch.zeros(50, 20), torch.zeros(7)])
    assert not fedlamb._default_foreach([torch.zeros(300, 300), torch.zeros(9)])
    assert not fedlamb._default_foreach([])
    calls = []

    def spy(*args, **kwargs):
        calls.append(len(args[0]))

    monkeypatch.setattr(fedlamb, "_foreach_fed_lamb", spy)
    params = [torch.zeros(4, 3, requires_grad=True), torch.zeros(3, requires_grad=True)]
    opt = FedLAMB(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == [2]


def test_default_foreach_tensor_subclass_takes_for_loop():
    """The policy shared with Δ-SGD: tensor subclasses loop, as in torch."""

    class Marked(torch.Tensor):
        pass

    small = torch.zeros(3)
    assert fedlamb._default_foreach([small])
    assert not fedlamb._default_foreach([small.as_subclass(Marked)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls", [FedLAMB, FedAMS])
def test_cuda_matches_cpu(cls):
    init, a, c, noise = _problem(9)
    runs = []
    for device in ("cpu", "cuda"):
        params = [
            torch.tensor(t, dtype=torch.float32, device=device, requires_grad=True)
            for t in init
        ]
        opt = cls(params, lr=0.01)  # foreach on CUDA, for-loop on CPU by default
        opt.load_second_moments(None)
        for t in range(5):
            opt.zero_grad()
            for p, g in zip(
                params,
                _np_grads([q.detach().cpu().numpy() for q in params], a, c, noise[t]),
                strict=True,
            ):
                p.grad = torch.tensor(g, dtype=torch.float32, device=device)
            opt.step()
        runs.append(([p.detach().cpu() for p in params], opt.second_moments()))
    for x, y in zip(runs[0][0], runs[1][0], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    for x, y in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(x, y.cpu(), rtol=1e-5, atol=1e-9)
