"""Model and data: a linear classifier on a fixed synthetic problem per client."""

import torch
from torch import nn


def make_model() -> nn.Module:
    """A tiny linear classifier."""
    return nn.Linear(10, 3)


def _labels(x):
    """The classes of one fixed linear teacher."""
    teacher = torch.randn(10, 3, generator=torch.Generator().manual_seed(1000))
    return (x @ teacher).argmax(dim=1)


def load_data(partition_id: int, num_partitions: int):
    """Each client gets its own (non-IID) shift of one synthetic problem."""
    g = torch.Generator().manual_seed(partition_id)
    x = torch.randn(200, 10, generator=g) + 0.5 * partition_id / max(num_partitions, 1)
    return x, _labels(x)


def load_centralized_dataset():
    """The server's test set: the same problem, unshifted, held out."""
    x = torch.randn(500, 10, generator=torch.Generator().manual_seed(10_000))
    return x, _labels(x)


def train(model: nn.Module, x, y, lr: float, steps: int) -> float:
    """Full-batch SGD; returns the last loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return float(loss.detach())


@torch.no_grad()
def test(model: nn.Module, x, y) -> tuple[float, float]:
    """Loss and accuracy."""
    out = model(x)
    return float(nn.functional.cross_entropy(out, y)), float(
        (out.argmax(1) == y).float().mean()
    )
