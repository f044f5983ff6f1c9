"""#40: a client's training round never imports ``torch._dynamo`` and gives the
numbers it gave with torch's decorated optimizer methods, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.optim.optimizer import Optimizer

from fedadapt.client.local import train_round
from fedadapt.config import validate_run_config
from fedadapt.optimizers import OPTIMIZERS
from fedadapt.optimizers._eager import EagerOptimizer, _undecorated
from fedadapt.tasks import TASKS

pytestmark = pytest.mark.app

#: the registry's torch optimizers and what the registry built before #40
TORCH_ORACLES = {
    "sgd": lambda model, lr, cfg: torch.optim.SGD(model.parameters(), lr=lr),
    "sgdm": lambda model, lr, cfg: torch.optim.SGD(
        model.parameters(), lr=lr, momentum=0.9
    ),
    "adam": lambda model, lr, cfg: torch.optim.Adam(
        model.parameters(), lr=lr, betas=(cfg["client-beta-1"], cfg["client-beta-2"])
    ),
    "adagrad": lambda model, lr, cfg: torch.optim.Adagrad(model.parameters(), lr=lr),
}
#: fedadapt's own optimizers (before #40 on torch.optim.Optimizer itself)
OWN = ("delta-sgd", "delta-sgd-consecutive", "sps", "fed-lamb", "fed-ams")


def _round(name: str) -> dict[str, torch.Tensor]:
    overrides = {"task": "digits-mlp", "client-optimizer": name, "local-steps": 6,
                 "local-epochs": 0, "batch-size": 16}  # fmt: skip
    if name in ("fed-lamb", "fed-ams"):
        overrides["strategy"] = "fed-lamb"
    cfg = validate_run_config(overrides)
    torch.manual_seed(0)
    state = TASKS.get("digits-mlp").build_model().state_dict()
    return train_round(cfg, 1, 3, state, lr=0.05, server_round=2).state


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", sorted(TORCH_ORACLES))
def test_torch_optimizers_round_is_bit_identical_to_torchs_classes(
    name: str, monkeypatch
) -> None:
    ours = _round(name)
    monkeypatch.setitem(OPTIMIZERS._items, name, TORCH_ORACLES[name])
    _assert_same(ours, _round(name))


@pytest.mark.parametrize("name", OWN)
def test_own_optimizers_round_is_bit_identical_on_torchs_base(
    name: str, monkeypatch
) -> None:
    ours = _round(name)
    # the behaviour before #40: torch's decorated group and gradient methods
    monkeypatch.setattr(EagerOptimizer, "add_param_group", Optimizer.add_param_group)
    monkeypatch.setattr(EagerOptimizer, "zero_grad", Optimizer.zero_grad)
    _assert_same(ours, _round(name))


def test_torchs_wrappers_are_still_unwrapped() -> None:
    """The speed-up rests on ``__wrapped__``: a torch without it is noticed here."""
    for method in (Optimizer.add_param_group, Optimizer.zero_grad,
                   torch.optim.SGD.step, torch.optim.Adam.step,
                   torch.optim.Adagrad.step):  # fmt: skip
        assert _undecorated(method) is not method, method


CLIENT_ROUND = """
import sys
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType
from flwr.supercore.task_identity import TaskIdentity
import torch
from fedadapt.client import client_app
from fedadapt.strategies import wire
from fedadapt.tasks import TASKS

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
state = TASKS.get("digits-mlp").build_model().state_dict()
config = ConfigRecord({wire.LR: 0.05, wire.SERVER_ROUND: 1})
for name in ("sgd", "delta-sgd"):
    run_config = {"task": "digits-mlp", "client-optimizer": name, "local-steps": 3}
    context = Context(1, 1, {"partition-id": 0, "num-partitions": 3}, RecordDict(),
                      run_config)
    for kind, handle in ((MessageType.TRAIN, client_app.train),
                         (MessageType.EVALUATE, client_app.evaluate)):
        content = RecordDict({wire.ARRAYS: ArrayRecord(state), wire.CONFIG: config})
        handle(Message(content, dst_node_id=1, message_type=kind), context)
unused = ("torch._dynamo", "sklearn", "scipy", "pandas", "flwr_datasets",
          "datasets", "torchvision", "matplotlib", "PIL", "pyarrow")
print(" ".join(m for m in unused if m in sys.modules) or "none")
"""


def test_a_client_round_in_a_fresh_process_imports_no_dynamo(tmp_path) -> None:
    """No dynamo ever; and from the node's ready files no data library either."""
    env = {**os.environ, "FEDADAPT_CACHE_DIR": str(tmp_path)}
    loaded = []
    for _ in range(2):  # the node's first messages, then later ones
        done = subprocess.run([sys.executable, "-c", CLIENT_ROUND],
                              capture_output=True, text=True, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        loaded.append(done.stdout.strip())
    assert "torch._dynamo" not in loaded[0]  # (the first computed the split)
    assert loaded[1] == "none"
