"""Client optimizers, selected by run-config ``client-optimizer``.

Each registry entry is a factory ``(params, lr, run_config) -> Optimizer``;
``lr`` is the round's client learning rate sent by the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fedadapt.registry import Registry

OptimizerFactory = Callable[
    [Iterable[torch.nn.Parameter], float, Mapping[str, Any]], torch.optim.Optimizer
]

OPTIMIZERS: Registry[OptimizerFactory] = Registry("client-optimizer")


@OPTIMIZERS.register("sgd")
def _sgd(
    params: Iterable[torch.nn.Parameter], lr: float, cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """Plain SGD, the local solver of FedAvg (McMahan et al., 2017)."""
    return torch.optim.SGD(params, lr=lr)


__all__ = ["OPTIMIZERS", "OptimizerFactory"]
