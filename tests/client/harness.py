"""The local-update tests' defaults over the public harness :mod:`fedadapt.testing`
(the digits-mlp model and run config most of them train)."""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, Context

from fedadapt import testing
from fedadapt.tasks import TASKS
from fedadapt.testing import Grid, InProcessProxy, linear_model

__all__ = [
    "RUN_CONFIG",
    "Grid",
    "InProcessProxy",
    "global_state",
    "linear_model",
    "make_contexts",
    "message_rounds",
]

RUN_CONFIG = {"task": "digits-mlp", "local-steps": 2, "batch-size": 16}


def global_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TASKS.get("digits-mlp").build_model().state_dict()


def make_contexts(num: int, run_config: dict | None = None) -> dict[int, Context]:
    """Nodes 1..num, partitions 0..num-1, each with ``run_config`` (RUN_CONFIG)."""
    return testing.make_contexts(num, RUN_CONFIG if run_config is None else run_config)


def message_rounds(
    strategy, contexts, rounds, replies_hook=None, first=1, **kwargs: Any
):
    """:func:`fedadapt.testing.message_rounds` from the digits-mlp model
    (round 1) or the strategy's last one (a later ``first``)."""
    arrays = strategy.training_arrays if first > 1 else ArrayRecord(global_state())
    return testing.message_rounds(
        strategy, contexts, rounds, arrays, first=first, replies_hook=replies_hook,
        **kwargs,
    )  # fmt: skip
