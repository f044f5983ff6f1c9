"""Models of the tasks."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """A one-hidden-layer perceptron: Linear → ReLU → Linear."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits."""
        return self.net(x)
