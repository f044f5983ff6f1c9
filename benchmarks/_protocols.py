"""Run configs that several benchmarks share (issue #30).

simulation_floor.py, message_overhead.py and same_numbers.py measure cells
of the same protocol: the Δ-SGD §4 MNIST setup on ``mnist5k-cnn``. Spelled
out in each, the copies could drift apart unnoticed, and the figures, read
together in docs/benchmarks.md, would then describe different cells. Here it
is read from the task's own ``paper_config`` (the source of
``conf/tasks/mnist5k-cnn.toml``), so the benchmarks run what a user runs.
"""

from __future__ import annotations

from typing import Any

from fedadapt.tasks import TASKS


def _delta_sgd_mnist5k() -> tuple[dict[str, Any], int]:
    setup = dict(TASKS.get("mnist5k-cnn").paper_config)
    clients = setup.pop("num-supernodes")
    setup.pop("num-server-rounds", None)  # each benchmark sets its own
    return {"task": "mnist5k-cnn", **setup}, clients


#: the Δ-SGD §4 protocol on mnist5k-cnn (100 clients × 500 samples, 10 per
#: round, 1 epoch, b = 64, Δ-SGD) without a round count, and its clients
DELTA_SGD_MNIST5K, DELTA_SGD_CLIENTS = _delta_sgd_mnist5k()

#: the same cells with FedAvg and plain SGD: what the plain-PyTorch floor and
#: the minimal Flower app implement (neither has Δ-SGD's step size); whole
#: local epochs, central evaluation every 10 rounds
SGD_MNIST5K: dict[str, Any] = {
    **DELTA_SGD_MNIST5K,
    "client-optimizer": "sgd",
    "client-lr": 0.05,
    "local-steps": 0,
    "evaluate-every": 10,
}
