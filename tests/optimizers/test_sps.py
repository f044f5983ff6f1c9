"""SPS client optimizer: closed forms and a float64 step-by-step reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedadapt.config import ConfigError, validate_run_config
from fedadapt.optimizers import OPTIMIZERS, SPS


def _quadratic(seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(12, 5))
    b = rng.normal(size=12)
    return a, b


def _reference(a, b, x0, lr, c, gamma, n, eps, steps):
    """NumPy float64 SPS on f(x) = ½‖Ax − b‖² / m, written from eq. (4)."""
    x, eta_prev, etas = x0.copy(), lr, []
    m = len(b)
    for _ in range(steps):
        r = a @ x - b
        f = 0.5 * r @ r / m
        g = a.T @ r / m
        eta = min(f / (c * g @ g + eps), gamma ** (1.0 / n) * eta_prev)
        x = x - eta * g
        eta_prev = eta
        etas.append(eta)
    return x, etas


def _closure(opt, params, a, b):
    at, bt = torch.tensor(a), torch.tensor(b)

    def closure():
        opt.zero_grad()
        x = torch.cat(params)
        r = at @ x - bt
        loss = 0.5 * (r @ r) / len(bt)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("lr", [1e-3, 10.0])
def test_matches_float64_reference_with_split_parameters(lr):
    """The global norm spans all tensors: splitting x in two changes nothing."""
    a, b = _quadratic()
    x0 = np.linspace(-1, 1, 5)
    params = [
        torch.tensor(x0[:2], requires_grad=True),
        torch.tensor(x0[2:], requires_grad=True),
    ]
    opt = SPS(params, lr=lr, c=0.5, gamma=2.0, steps_per_epoch=3, eps=1e-8)
    closure = _closure(opt, params, a, b)
    for _ in range(15):
        opt.step(closure)
    x_ref, etas_ref = _reference(a, b, x0, lr, 0.5, 2.0, 3, 1e-8, 15)
    np.testing.assert_allclose(torch.cat(params).detach().numpy(), x_ref, rtol=1e-12)
    np.testing.assert_allclose(opt.history[0], etas_ref, rtol=1e-12)
    stats = opt.stats()
    assert stats["steps"] == 15 and stats["eta-last"] == pytest.approx(etas_ref[-1])
    if lr == 1e-3:  # the cap binds: η_k = 2^{(k+1)/3}·lr exactly
        assert etas_ref[0] == pytest.approx(2 ** (1 / 3) * lr)


def test_polyak_step_solves_a_one_dimensional_quadratic_in_one_step():
    """f(x) = ½x², c = ½: η = f / (c f'²) = 1 and x − 1·x = 0 (closed form)."""
    x = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)
    opt = SPS([x], lr=100.0, c=0.5, eps=0.0)

    def closure():
        opt.zero_grad()
        loss = 0.5 * (x**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert x.item() == 0.0
    assert opt.history[0] == [1.0]


def test_zero_gradient_does_not_move_nor_freeze_the_cap():
    x = torch.tensor([0.0, 0.0], requires_grad=True)
    opt = SPS([x], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (x**2).sum() + 1.0  # gradient 0 at the origin, loss 1
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.equal(x, torch.zeros(2))
    assert opt.param_groups[0]["lr"] == 0.5  # the official code would set 0
    assert opt.history[0] == [0.0]


def test_non_finite_loss_changes_nothing():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = SPS([x])

    def closure():
        opt.zero_grad()
        loss = (x * float("nan")).sum()
        loss.backward()
        return loss

    with pytest.raises(FloatingPointError, match="non-finite loss"):
        opt.step(closure)
    assert torch.equal(x.detach(), torch.tensor([1.0, 2.0]))


def test_needs_a_closure_and_valid_hyperparameters():
    x = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="closure"):
        SPS([x]).step()
    for bad in ({"lr": 0.0}, {"c": -1.0}, {"gamma": 0.5}, {"steps_per_epoch": 0},
                {"eps": float("nan")}, {"f_star": float("inf")}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            SPS([x], **bad)


def test_registered_as_a_client_optimizer():
    model = torch.nn.Linear(3, 2)
    opt = OPTIMIZERS.get("sps")(model, 0.7, {})
    assert isinstance(opt, SPS) and opt.param_groups[0]["lr"] == 0.7
    assert validate_run_config({"client-optimizer": "sps"})["client-optimizer"] == "sps"
    with pytest.raises(ConfigError, match="client-optimizer"):
        validate_run_config({"client-optimizer": "spss"})
