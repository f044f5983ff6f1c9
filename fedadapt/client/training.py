"""Local training shared by every Flower client of fedadapt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedadapt.client.local_update import ClientUpdate
from fedadapt.tasks.base import batch_loader


@dataclass(frozen=True)
class TrainResult:
    """What one client's local training reports back."""

    loss: float
    accuracy: float | None
    num_examples: int
    steps: int
    update_sq_norm: float
    optimizer_stats: dict[str, float]


def _batches(loader: DataLoader, epochs: int, steps: int) -> Iterator[tuple]:
    """Yield ``steps`` batches (cycling over epochs) or ``epochs`` full passes."""
    if steps > 0:
        done = 0
        while True:
            for batch in loader:
                yield batch
                done += 1
                if done == steps:
                    return
    else:
        for _ in range(epochs):
            yield from loader


def train_local(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    dataset: Dataset,
    *,
    epochs: int,
    steps: int,
    batch_size: int,
    seed: int,
    device: torch.device,
    classification: bool = True,
    weight_decay: float = 0.0,
    grad_clip: float = 0.0,
    local_update: ClientUpdate | None = None,
) -> TrainResult:
    """Train ``model`` in place and report loss, accuracy and ‖x_i − x_t‖².

    ``steps > 0`` runs exactly that many optimizer steps, otherwise ``epochs``
    passes. Shuffling is seeded by ``seed``. Every optimizer is stepped with a
    closure (torch's LBFGS contract), which Δ-SGD's same-batch mode needs to
    re-evaluate the gradient at the previous iterate; loss and accuracy are
    taken from the closure's first call, at the current iterate. Running sums
    stay on the device (no host synchronisation per step); the squared update
    norm is computed over the trainable parameters in float64 on the device.

    ``grad_clip > 0`` clips the loss gradient to that L2 norm over all
    parameters, then ``weight_decay`` adds λ·x to it, in this order as the
    FedExP code that DUA follows (App. H.1: "weight decay of 1e-4 [...] and
    gradient clipping"; ``clip_grad_norm_`` before ``SGD(weight_decay)``'s
    step). Both act inside the closure, so every optimizer (and Δ-SGD's
    re-evaluation at the previous iterate) sees the same gradient.

    ``local_update`` (an algorithm's client half, already begun) acts inside
    the closure too: its :meth:`~ClientUpdate.loss_term` is added to the
    task loss before ``backward`` (the closure returns that objective, which
    loss-based optimizers such as SPS read), its
    :meth:`~ClientUpdate.after_backward` then changes the gradients, after
    clipping and weight decay (our choice: a control variate or momentum
    correction is not clipped). The reported ``loss`` stays the task loss.
    """
    model.to(device).train()
    start = [p.detach().clone() for p in model.parameters()]
    loader = batch_loader(
        dataset,
        batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=device.type == "cuda",
    )
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = num_steps = 0
    for inputs, targets in _batches(loader, epochs, steps):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        first: list[tuple[torch.Tensor, torch.Tensor]] = []

        def closure(inputs=inputs, targets=targets, first=first) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            outputs = model(inputs)
            loss = criterion(outputs, targets)
            objective = loss
            if local_update is not None:
                term = local_update.loss_term(model, inputs, targets, outputs)
                if term is not None:
                    objective = loss + term
            objective.backward()
            if grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if weight_decay > 0:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.add_(p.detach(), alpha=weight_decay)
            if local_update is not None:
                local_update.after_backward(model, inputs, targets)
            if not first:
                first.append((loss.detach(), outputs.detach()))
            return objective

        # torch's stub types closures as returning float; LBFGS-style closures
        # (torch's own contract) return the loss tensor
        optimizer.step(closure)  # type: ignore[arg-type]
        loss, outputs = first[0]
        loss_sum += loss.double() * len(targets)
        if classification:
            correct += (outputs.argmax(dim=1) == targets).sum()
        count += len(targets)
        num_steps += 1
    if count == 0:
        raise ValueError("local training saw no data (empty local dataset)")
    with torch.no_grad():
        sq_norm = sum(
            torch.sum((p.detach().double() - p0.double()) ** 2)
            for p, p0 in zip(model.parameters(), start, strict=True)
        )
    return TrainResult(
        loss=loss_sum.item() / count,
        accuracy=correct.item() / count if classification else None,
        num_examples=len(dataset),  # type: ignore[arg-type]
        steps=num_steps,
        update_sq_norm=float(sq_norm),
        optimizer_stats=optimizer_stats(optimizer),
    )


def optimizer_stats(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Per-round optimizer metrics for the reply (e.g. Δ-SGD's step sizes)."""
    stats = getattr(optimizer, "stats", None)
    if stats is None:
        return {}
    return {f"opt-{k}": float(v) for k, v in stats().items()}
