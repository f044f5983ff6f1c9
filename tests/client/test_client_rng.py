"""A client round's random draws (dropout) are the client's own: seeded per
client round, whatever the process served before (#30: found when a CNN
cell gave other numbers on every run; one Ray actor serves many clients)."""

from __future__ import annotations

import torch

from fedadapt.client.local import train_round
from fedadapt.config import validate_run_config
from fedadapt.tasks import TASKS

# the Δ-SGD CNN has Dropout2d and dropout: its masks come from the global RNG
CFG = validate_run_config(
    {"task": "mnist5k-cnn", "local-steps": 3, "batch-size": 16, "seed": 3}
)


def _round(server_round: int, rng_before: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    start = TASKS.get("mnist5k-cnn").build_model().state_dict()
    torch.manual_seed(rng_before)  # what the process drew before: varies
    return train_round(CFG, 4, 100, start, 0.05, server_round).state


def test_a_client_round_is_the_same_whatever_the_process_drew_before():
    first, second = _round(2, rng_before=1), _round(2, rng_before=12345)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_the_callers_rng_is_left_as_it_was():
    torch.manual_seed(7)
    state = TASKS.get("mnist5k-cnn").build_model().state_dict()
    before = torch.get_rng_state()
    train_round(CFG, 4, 100, state, 0.05, 1)
    assert torch.equal(torch.get_rng_state(), before)
