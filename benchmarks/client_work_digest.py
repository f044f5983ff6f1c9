"""Digest of the client work of a few rounds, in one process (issue #30).

Companion to same_numbers.py for models with dropout: runs train_round /
evaluate_round for a fixed sequence of clients with the global torch RNG
seeded once (Δ-SGD on mnist5k-cnn, SGD on digits with client evaluation) and
prints a SHA-256 of every returned state and metric. Run it on the code
before and after a change: equal digests mean bit-identical client work.

    PYTHONPATH=. python benchmarks/client_work_digest.py
"""

import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedadapt.client.local import evaluate_round, train_round  # noqa: E402
from fedadapt.config import validate_run_config  # noqa: E402
from fedadapt.tasks import TASKS  # noqa: E402

h = hashlib.sha256()
for cfgd, num in [
    (
        {
            "task": "mnist5k-cnn",
            "partition": "delta-sgd",
            "dirichlet-alpha": 0.1,
            "samples-per-client": 500,
            "client-test-fraction": 0.0,
            "local-epochs": 1,
            "batch-size": 64,
            "client-optimizer": "delta-sgd",
            "client-lr": 0.2,
        },
        100,
    ),
    (
        {
            "task": "digits-mlp",
            "partition": "dirichlet",
            "dirichlet-alpha": 0.5,
            "local-epochs": 2,
            "batch-size": 32,
            "client-optimizer": "sgd",
            "client-lr": 0.1,
            "client-test-fraction": 0.2,
        },
        10,
    ),
]:
    cfg = validate_run_config(cfgd)
    torch.manual_seed(123)
    state = TASKS.get(cfg["task"]).build_model().state_dict()
    for rnd, pid in [(1, 3), (1, 7), (2, 3), (2, 9), (3, 0)]:
        res = train_round(cfg, pid, num, state, lr=cfg["client-lr"], server_round=rnd)
        for v in res.state.values():
            h.update(v.numpy().tobytes())
        h.update(repr(sorted(res.metrics.items())).encode())
        state = res.state
        if cfg["client-test-fraction"] > 0:
            h.update(
                repr(sorted(evaluate_round(cfg, pid, num, state).items())).encode()
            )
print(h.hexdigest())
