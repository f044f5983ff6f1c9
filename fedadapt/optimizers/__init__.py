"""Client optimizers, selected by run-config ``client-optimizer``.

Each registry entry is a factory ``(model, lr, run_config) -> Optimizer``;
``lr`` is the round's client learning rate sent by the server (η0 for
Δ-SGD). A fresh optimizer is built every round, which is the per-round reset
that Δ-SGD (arXiv:2306.11201, Algorithm 1 line 6: η and θ restart at η0, θ0)
and Fed-LAMB / Fed-AMS (arXiv:2110.00532, Algorithm 1: m restarts at 0)
prescribe.

torch's SGD, Adam and Adagrad are built as :mod:`fedadapt.optimizers._eager`'s
subclasses, which compute the same values without importing
``torch._dynamo`` (seconds per deployment ClientApp process, #40).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fedadapt.optimizers._eager import SGD, Adagrad, Adam
from fedadapt.optimizers.deltasgd import DeltaSGD, StepInfo, preserve_buffers
from fedadapt.optimizers.fedlamb import FedAMS, FedLAMB
from fedadapt.optimizers.sps import SPS
from fedadapt.registry import Registry
from fedadapt.strategies.fedlamb import PAPER as FED_LAMB_PAPER
from fedadapt.strategies.param import Paper

OptimizerFactory = Callable[
    [nn.Module, float, Mapping[str, Any]], torch.optim.Optimizer
]

OPTIMIZERS: Registry[OptimizerFactory] = Registry("client-optimizer")

#: the client optimizers' papers, for the papers table of docs/algorithms.md
#: (generated): (algorithm names, module, paper)
PAPERS: tuple[tuple[str, str, Paper], ...] = (
    ("Fed-LAMB, Fed-AMS", "fedadapt.optimizers.fedlamb", FED_LAMB_PAPER),
    (
        "Δ-SGD",
        "fedadapt.optimizers.deltasgd",
        Paper(
            "Kim et al. 2024",
            "Kim, Toghani, Uribe, Kyrillidis, *Adaptive Federated Learning with "
            "Auto-Tuned Clients*, ICLR 2024 (Algorithm 1)",
        ),
    ),
    (
        "SPS",
        "fedadapt.optimizers.sps",
        Paper(
            "Loizou et al. 2021",
            "Loizou et al., *Stochastic Polyak Step-size for SGD*, AISTATS 2021",
        ),
    ),
)


def _client_betas(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """(β1, β2) of the Adam-like client optimizers, from the run config."""
    return cfg["client-beta-1"], cfg["client-beta-2"]


def _configured_delta_sgd(
    model: nn.Module, lr: float, cfg: Mapping[str, Any], mode: str
) -> DeltaSGD:
    """Δ-SGD with the run config's γ and δ, in ``mode``.

    ``module=model`` keeps BatchNorm statistics out of the extra
    ``same_batch`` pass; ``consecutive`` has no extra pass and ignores it.
    """
    return DeltaSGD(
        model.parameters(),
        lr=lr,
        gamma=cfg["delta-sgd-gamma"],
        delta=cfg["delta-sgd-delta"],
        mode=mode,
        module=model,
    )


@OPTIMIZERS.register("sgd")
def _sgd(model: nn.Module, lr: float, cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    """Plain SGD, the local solver of FedAvg (McMahan et al., arXiv:1602.05629)."""
    return SGD(model.parameters(), lr=lr)


@OPTIMIZERS.register("sgdm")
def _sgdm(model: nn.Module, lr: float, cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, restarted every round (arXiv:2306.11201 baseline)."""
    return SGD(model.parameters(), lr=lr, momentum=0.9)


@OPTIMIZERS.register("delta-sgd")
def _delta_sgd(
    model: nn.Module, lr: float, cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """Δ-SGD with the same-batch smoothness estimate (two passes per step).

    As in the experiments and official code of arXiv:2306.11201: both
    gradients of Algorithm 1 line 9 on the current batch.
    """
    return _configured_delta_sgd(model, lr, cfg, "same_batch")


@OPTIMIZERS.register("delta-sgd-consecutive")
def _delta_sgd_consecutive(
    model: nn.Module, lr: float, cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """Δ-SGD comparing consecutive mini-batch gradients (one pass per step).

    The other reading of Algorithm 1 line 9 of arXiv:2306.11201 (the remark
    after it allows different batches): half the passes of ``delta-sgd``.
    """
    return _configured_delta_sgd(model, lr, cfg, "consecutive")


@OPTIMIZERS.register("fed-lamb")
def _fed_lamb(
    model: nn.Module, lr: float, cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """Fed-LAMB client (arXiv:2110.00532 Algorithm 1; needs strategy fed-lamb)."""
    return FedLAMB(
        model.parameters(),
        lr=lr,
        betas=_client_betas(cfg),
        weight_decay=cfg["fed-lamb-lambda"],
    )


@OPTIMIZERS.register("fed-ams")
def _fed_ams(
    model: nn.Module, lr: float, cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """Fed-AMS client (local AMSGrad, arXiv:2110.00532; needs strategy fed-lamb)."""
    return FedAMS(model.parameters(), lr=lr, betas=_client_betas(cfg))


@OPTIMIZERS.register("adam")
def _adam(model: nn.Module, lr: float, cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    """torch.optim.Adam restarted every round (a baseline of arXiv:2306.11201)."""
    return Adam(model.parameters(), lr=lr, betas=_client_betas(cfg))


@OPTIMIZERS.register("adagrad")
def _adagrad(
    model: nn.Module, lr: float, cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """torch.optim.Adagrad restarted every round (a Δ-SGD paper baseline, §4).

    Defaults of torch (and of the Δ-SGD code): no lr decay, initial
    accumulator 0, ε = 1e-10.
    """
    return Adagrad(model.parameters(), lr=lr)


@OPTIMIZERS.register("sps")
def _sps(model: nn.Module, lr: float, cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    """Stochastic Polyak step size (arXiv:2002.10542), official defaults.

    A baseline of arXiv:2306.11201.

    ``client-lr`` is the initial step size that caps the first step.
    """
    return SPS(model.parameters(), lr=lr)


def uses_second_moments(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer exchanges v / v̂ with the server (Fed-LAMB/AMS)."""
    return hasattr(optimizer, "load_second_moments")


__all__ = [
    "OPTIMIZERS",
    "DeltaSGD",
    "FedAMS",
    "FedLAMB",
    "SPS",
    "OptimizerFactory",
    "StepInfo",
    "preserve_buffers",
    "uses_second_moments",
]
