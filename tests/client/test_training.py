"""Local training loop against closed-form gradient steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedadapt.client.training import train_local
from fedadapt.tasks import TASKS, pick_device


def _linear_problem(n=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    return x, y


def _run(x, y, w0, *, lr, epochs=0, steps=0, batch_size, **tricks):
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(w0.T.copy()))
    result = train_local(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        nn.MSELoss(),
        TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        epochs=epochs,
        steps=steps,
        batch_size=batch_size,
        seed=0,
        device=torch.device("cpu"),
        classification=False,
        **tricks,
    )
    return model.weight.detach().numpy().T.astype(np.float64), result


def test_full_batch_sgd_matches_closed_form_gradient_steps():
    # Prepare: MSE loss f(w) = mean((Xw - y)^2), gradient 2/n X^T (Xw - y)
    x, y = _linear_problem()
    w0 = np.array([[0.5], [-1.0], [2.0]])
    lr, n = 0.1, len(x)
    w, losses = w0.copy(), []
    for _ in range(3):
        residual = x.astype(np.float64) @ w - y
        losses.append(float(np.mean(residual**2)))
        w = w - lr * 2.0 / n * x.T @ residual
    # Execute
    w_trained, result = _run(x, y, w0, lr=lr, steps=3, batch_size=n)
    # Assert
    np.testing.assert_allclose(w_trained, w, rtol=1e-5)
    assert result.steps == 3 and result.num_examples == n
    assert result.loss == pytest.approx(np.mean(losses), rel=1e-5)
    assert result.accuracy is None
    assert result.update_sq_norm == pytest.approx(
        float(np.sum((w - w0) ** 2)), rel=1e-4
    )


@pytest.mark.parametrize(
    ("clip", "decay"), [(0.0, 0.05), (0.5, 0.0), (0.5, 0.05), (100.0, 0.05)]
)
def test_clipping_then_weight_decay_match_closed_form(clip, decay):
    """DUA App. H.1 tricks (FedExP code): g ← clip(∇f, c), then g + λw, then SGD.

    Hand-written full-batch steps; the clip is active at c = 0.5 (‖∇f‖ ≈ 4
    at w0) and inactive at c = 100.
    """
    x, y = _linear_problem()
    w0 = np.array([[0.5], [-1.0], [2.0]])
    lr, n = 0.1, len(x)
    w = w0.copy()
    for _ in range(3):
        g = 2.0 / n * x.T @ (x.astype(np.float64) @ w - y)
        if clip > 0:
            g = g * min(1.0, clip / np.linalg.norm(g))
        w = w - lr * (g + decay * w)
    assert np.linalg.norm(2.0 / n * x.T @ (x @ w0 - y)) > 2.0  # clip 0.5 acts
    w_trained, _ = _run(x, y, w0, lr=lr, steps=3, batch_size=n, grad_clip=clip,
                        weight_decay=decay)  # fmt: skip
    np.testing.assert_allclose(w_trained, w, rtol=1e-5)


def test_client_lr_decays_per_round():
    """η_l·0.998^(t−1) (DUA App. H.1): round 1 trains with η_l itself."""
    from fedadapt.client.local import round_lr

    assert round_lr(0.1, 0.998, 1) == 0.1
    assert round_lr(0.1, 0.998, 0) == 0.1
    assert round_lr(0.1, 0.998, 3) == pytest.approx(0.1 * 0.998**2, rel=1e-15)
    assert round_lr(0.1, 1.0, 500) == 0.1


def test_client_lr_step_schedule_is_the_delta_sgd_down_baseline():
    """client-lr-schedule=step: η_l/10 after 50% and /100 after 75% of T rounds.

    Δ-SGD ICLR §4 ("divided by 10 after 50%, and another by 10 after 75% of
    the total training rounds"); with T = 500 the official code decays at
    1-based rounds 251 and 376. Composes with client-lr-decay.
    """
    from fedadapt.client.local import round_lr

    def paper(t: int, total: int) -> float:  # the rounds written out
        done = t - 1  # rounds finished before round t
        return 0.1 if done < total // 2 else 0.01 if done < 3 * total // 4 else 0.001

    for total in (500, 20, 7, 4):
        for t in range(1, total + 1):
            got = round_lr(0.1, 1.0, t, "step", total)
            assert got == pytest.approx(paper(t, total), rel=1e-15), (total, t)
    assert [round_lr(0.1, 1.0, t, "step", 500) for t in (250, 251, 375, 376)] == [
        pytest.approx(v, rel=1e-15) for v in (0.1, 0.01, 0.01, 0.001)
    ]
    assert round_lr(0.1, 0.5, 12, "step", 20) == pytest.approx(
        0.1 * 0.5**11 / 10, rel=1e-15
    )
    assert round_lr(0.1, 0.998, 400, "constant", 500) == round_lr(0.1, 0.998, 400)
    with pytest.raises(ValueError, match="client-lr-schedule"):
        round_lr(0.1, 1.0, 1, "cosine", 10)


def test_train_round_follows_the_client_lr_schedule(cfg):
    """train_round (both client APIs) trains round t with the step schedule's lr."""
    from fedadapt.client.local import train_round

    config = cfg(**{"local-steps": 1, "batch-size": 4096, "num-server-rounds": 4})
    step = {**config, "client-lr-schedule": "step"}
    torch.manual_seed(0)
    state = TASKS.get("digits-mlp").build_model().state_dict()

    def norm(run_config, server_round):
        run = train_round(run_config, 0, 10, state, 0.1, server_round=server_round)
        return run.metrics["update-sq-norm"]

    # one full-batch SGD step: ‖Δ‖² ∝ lr²; T = 4: rounds 1-2 η, 3 η/10, 4 η/100
    assert norm(step, 2) == norm(config, 2)
    assert norm(step, 3) == pytest.approx(norm(config, 3) / 1e2, rel=1e-5)
    assert norm(step, 4) == pytest.approx(norm(config, 4) / 1e4, rel=1e-5)


def test_train_round_applies_the_decayed_lr_and_tricks(cfg):
    """train_round passes client-lr-decay, weight decay and clipping on."""
    from fedadapt.client.local import train_round

    config = cfg(**{"client-lr-decay": 0.5, "local-steps": 1, "batch-size": 4096})
    task = TASKS.get("digits-mlp")
    torch.manual_seed(0)
    state = task.build_model().state_dict()

    def norm(**over):
        run = train_round({**config, **over}, 0, 10, state, 0.1, server_round=3)
        return run.metrics["update-sq-norm"]

    # one full-batch SGD step: ‖Δ‖² scales with lr², so round 3 (lr·0.25) gives
    # 1/16 of round 1's squared update
    first = train_round(config, 0, 10, state, 0.1, server_round=1)
    assert norm() == pytest.approx(first.metrics["update-sq-norm"] / 16, rel=1e-5)
    # clipping to a tiny norm bounds the step: ‖Δ‖ = lr·0.25·c
    assert norm(**{"client-grad-clip": 1e-3}) == pytest.approx(
        (0.1 * 0.25 * 1e-3) ** 2, rel=1e-4
    )
    assert norm(**{"client-weight-decay": 1.0}) != pytest.approx(norm(), rel=1e-3)


@pytest.mark.parametrize(
    ("epochs", "steps", "expected"), [(1, 0, 3), (2, 0, 6), (0, 5, 5), (3, 2, 2)]
)
def test_epochs_or_steps_decide_the_number_of_steps(epochs, steps, expected):
    x, y = _linear_problem(n=10)
    _, result = _run(x, y, np.zeros((3, 1)), lr=0.01, epochs=epochs, steps=steps,
                     batch_size=4)  # fmt: skip
    assert result.steps == expected


def test_digits_task_model_trains_and_reports_accuracy(cfg):
    task = TASKS.get("digits-mlp")
    data = task.load_client(cfg(), 0, 10)
    torch.manual_seed(0)
    model = task.build_model()
    first = train_local(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        task.criterion(), data.train, epochs=5, steps=0,
                        batch_size=16, seed=0, device=pick_device("cpu"))  # fmt: skip
    again = train_local(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        task.criterion(), data.train, epochs=5, steps=0,
                        batch_size=16, seed=1, device=pick_device("cpu"))  # fmt: skip
    assert 0.0 <= first.accuracy <= 1.0
    assert again.loss < first.loss
    assert first.update_sq_norm > 0


def test_device_choice():
    assert pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sees no CUDA device"):
            pick_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("optimizer", ["sgd", "delta-sgd"])
def test_training_on_cuda_matches_cpu(optimizer):
    """Issue #5: client training runs unchanged on CUDA (same result as CPU)."""
    from fedadapt.optimizers import DeltaSGD

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    y = (x.sum(dim=1) > 0).long()
    data = TensorDataset(x, y)

    def run(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.1)
            if optimizer == "sgd"
            else DeltaSGD(model.parameters(), lr=0.2, module=model)
        )
        model.to(device)
        result = train_local(model, opt, nn.CrossEntropyLoss(), data, epochs=2,
                             steps=0, batch_size=16, seed=0, device=device)  # fmt: skip
        return result, [p.detach().cpu() for p in model.parameters()]

    (cpu, cpu_params), (gpu, gpu_params) = (
        run(torch.device("cpu")),
        run(torch.device("cuda:0")),
    )
    assert gpu.loss == pytest.approx(cpu.loss, rel=1e-4)
    assert gpu.update_sq_norm == pytest.approx(cpu.update_sq_norm, rel=1e-4)
    for a, b in zip(cpu_params, gpu_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_adagrad_client_optimizer_is_a_fresh_adagrad_each_round():
    """Δ-SGD's Adagrad baseline: x ← x − η·g/(√(Σg²) + 1e-10), state reset."""
    from fedadapt.optimizers import OPTIMIZERS

    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
    x = torch.tensor([[3.0, 1.0]])
    w = np.array([1.0, -2.0])
    acc = np.zeros(2)
    opt = OPTIMIZERS.get("adagrad")(model, 0.5, {})
    for _ in range(2):
        g = 2.0 * (x.numpy()[0] @ w) * x.numpy()[0]  # d/dw (x·w)²
        acc += g**2
        w = w - 0.5 * g / (np.sqrt(acc) + 1e-10)
        opt.zero_grad()
        (model(x) ** 2).sum().backward()
        opt.step()
    np.testing.assert_allclose(model.weight.detach().numpy()[0], w, rtol=1e-6)
