"""Digits (scikit-learn), an MLP 64→64→10, local SGD steps and evaluation."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def load_digits(partition_id: int, num_partitions: int):
    """Client ``partition_id``'s share (IID) of the train split, and the test split."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    data = sk_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    tr, te = train_test_split(
        np.arange(len(y)), test_size=0.2, stratify=data.target, random_state=0
    )
    mine = np.array_split(np.random.default_rng(0).permutation(tr), num_partitions)
    part = mine[partition_id]
    return (x[part], y[part]), (x[te], y[te])


def build_model() -> nn.Module:
    """The same MLP as fedadapt's digits-mlp."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(model: nn.Module, data, steps: int, batch_size: int, lr: float) -> float:
    """Run ``steps`` SGD steps on random mini-batches; return the last loss."""
    x, y = data
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        batch = torch.randint(len(y), (batch_size,))
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
    return float(loss)


@torch.no_grad()
def evaluate(model: nn.Module, data) -> tuple[float, float]:
    """Mean loss and accuracy on ``data``."""
    x, y = data
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    return float(loss), float((out.argmax(1) == y).float().mean())
