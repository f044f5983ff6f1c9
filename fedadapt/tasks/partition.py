"""Splitting a labelled training set over federated clients.

Pure NumPy and deterministic from a seed: every client computes the same full
partition and keeps its own part, so no coordination is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedadapt.registry import Registry

Partition = list[NDArray[np.int64]]
PartitionFn = Callable[[NDArray[Any], int, Mapping[str, Any]], Partition]

PARTITIONS: Registry[PartitionFn] = Registry("partition")


def _check_count(num_samples: int, num_partitions: int, min_size: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"Invalid num_partitions: {num_partitions}")
    if num_samples < num_partitions * min_size:
        raise ValueError(
            f"Cannot give {num_partitions} clients at least {min_size} samples each "
            f"from {num_samples} samples; use fewer clients or a larger dataset"
        )


def iid_partition(num_samples: int, num_partitions: int, seed: int) -> Partition:
    """Shuffle the indices and cut them into near-equal parts."""
    _check_count(num_samples, num_partitions, 1)
    order = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(part) for part in np.array_split(order, num_partitions)]


def dirichlet_partition(
    labels: NDArray[Any],
    num_partitions: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_tries: int = 1000,
) -> Partition:
    """Label-skewed split: each class is divided by proportions ~ Dir(α·1).

    The scheme of Hsu et al. (2019, arXiv:1909.06335), also used by
    flwr-datasets' ``DirichletPartitioner``: for every class, draw client
    proportions from a symmetric Dirichlet(α) and cut that class's shuffled
    indices accordingly. Draws are repeated until every client holds at least
    ``min_size`` samples. Every sample is assigned to exactly one client.
    """
    if not alpha > 0:
        raise ValueError(f"Invalid alpha: {alpha}")
    labels = np.asarray(labels)
    _check_count(len(labels), num_partitions, min_size)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[NDArray[np.int64]]] = [[] for _ in range(num_partitions)]
        for cls in classes:
            members = rng.permutation(np.flatnonzero(labels == cls))
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for part, chunk in zip(parts, np.split(members, cuts), strict=True):
                part.append(chunk)
        merged = [np.sort(np.concatenate(part)) for part in parts]
        if min(len(part) for part in merged) >= min_size:
            return merged
    raise ValueError(
        f"No Dirichlet(alpha={alpha}) draw in {max_tries} tries gave every one of "
        f"{num_partitions} clients {min_size} samples; raise alpha or use fewer clients"
    )


def train_test_split_indices(
    indices: NDArray[np.int64], test_fraction: float, seed: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Split one client's indices into local train and test parts.

    The test part gets ``round(test_fraction * n)`` samples, but at least one
    sample always stays in the train part.
    """
    shuffled = np.random.default_rng(seed).permutation(indices)
    n_test = min(int(round(test_fraction * len(indices))), len(indices) - 1)
    return np.sort(shuffled[n_test:]), np.sort(shuffled[:n_test])


@PARTITIONS.register("iid")
def _iid(
    labels: NDArray[Any], num_partitions: int, cfg: Mapping[str, Any]
) -> Partition:
    return iid_partition(len(labels), num_partitions, cfg["seed"])


@PARTITIONS.register("dirichlet")
def _dirichlet(
    labels: NDArray[Any], num_partitions: int, cfg: Mapping[str, Any]
) -> Partition:
    return dirichlet_partition(
        labels, num_partitions, cfg["dirichlet-alpha"], cfg["seed"]
    )
