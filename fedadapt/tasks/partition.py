"""Splitting a labelled training set over federated clients.

Selected by run-config ``partition``; deterministic from run-config ``seed``:
every client computes the same full partition and keeps its own part, so no
coordination is needed (results are cached per process and on disk, see
:func:`cache_dir`).

Where Flower Datasets implements the papers' scheme we use its partitioner
(on a two-column ``datasets.Dataset`` of labels and row indices):

=================  ==========================================================
``iid``            shuffled equal split (flwr-datasets ``IidPartitioner``)
``dirichlet``      per-class Dir(α) proportions, Hsu et al. 2019 (flwr-datasets
                   ``DirichletPartitioner``, min. 10 samples per client)
``dirichlet-equal`` equal client sizes, per-client Dir(α) class mix without
                   replacement (flwr-datasets ``InnerDirichletPartitioner``;
                   FedExP's ``getDirichletData_equal``, our reading of FedDuA
                   §5.1's unstated Dirichlet split)
``shards``         ``classes-per-client`` classes each, the pathological
                   split (flwr-datasets ``PathologicalPartitioner``; 1 class
                   per client is Fed-LAMB's non-iid MNIST, arXiv:2110.00532
                   §4)
``delta-sgd``      the Δ-SGD code's sampler (arXiv:2306.11201 §4 cites Hsu et
                   al., arXiv:1909.06335; code ``sampling.py``), which flwr-datasets
                   lacks: per client q ~ Dir(α·p), ``round(n·q)`` samples per
                   class (remainder to the last class), drawn *with
                   replacement* and independently per client, so clients may
                   overlap (the paper's "randomly partitioning" is, in the
                   code, this per-class sampling with replacement)
=================  ==========================================================
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from torch.utils.data import Dataset, Subset

from fedadapt._atomic import atomic_open
from fedadapt.registry import Registry
from fedadapt.tasks.base import ClientData

Partition = list[NDArray[np.int64]]
PartitionFn = Callable[[NDArray[Any], int, Mapping[str, Any]], Partition]

PARTITIONS: Registry[PartitionFn] = Registry("partition")

DIRICHLET_MIN_SIZE = 10


def _with_flower_partitioner(
    labels: NDArray[Any], num_partitions: int, make: Callable[[], Any]
) -> Partition:
    """Run a flwr-datasets partitioner over ``labels``; return row indices."""
    import datasets

    labels = np.asarray(labels)
    table = datasets.Dataset.from_dict(
        {"label": labels.tolist(), "row": np.arange(len(labels)).tolist()}
    )
    partitioner = make()
    partitioner.dataset = table
    try:
        return [
            np.sort(np.asarray(partitioner.load_partition(i)["row"], dtype=np.int64))
            for i in range(num_partitions)
        ]
    except ValueError as error:  # e.g. no Dirichlet draw met the minimum size
        raise ValueError(
            f"cannot split {len(labels)} samples over {num_partitions} clients: {error}"
        ) from None


def _check_count(num_samples: int, num_partitions: int, min_size: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"Invalid num_partitions: {num_partitions}")
    if num_samples < num_partitions * min_size:
        raise ValueError(
            f"Cannot give {num_partitions} clients at least {min_size} samples each "
            f"from {num_samples} samples; use fewer clients or a larger dataset"
        )


def iid_partition(labels: NDArray[Any], num_partitions: int, seed: int) -> Partition:
    """Shuffle with ``seed``, then near-equal contiguous parts (IidPartitioner)."""
    from flwr_datasets.partitioner import IidPartitioner

    _check_count(len(labels), num_partitions, 1)
    order = np.random.default_rng(seed).permutation(len(labels))
    parts = _with_flower_partitioner(
        np.asarray(labels)[order],
        num_partitions,
        lambda: IidPartitioner(num_partitions),
    )
    return [np.sort(order[p]) for p in parts]


def dirichlet_partition(
    labels: NDArray[Any],
    num_partitions: int,
    alpha: float,
    seed: int,
    min_size: int = DIRICHLET_MIN_SIZE,
) -> Partition:
    """Label-skewed split: each class divided by proportions ~ Dir(α·1).

    Hsu et al. (2019, arXiv:1909.06335) via flwr-datasets'
    ``DirichletPartitioner``; redrawn until every client holds ``min_size``
    samples. Every sample is assigned to exactly one client.
    """
    from flwr_datasets.partitioner import DirichletPartitioner

    if not alpha > 0:
        raise ValueError(f"Invalid alpha: {alpha}")
    _check_count(len(labels), num_partitions, min_size)
    return _with_flower_partitioner(
        labels,
        num_partitions,
        lambda: DirichletPartitioner(
            num_partitions, "label", alpha, min_partition_size=min_size, seed=seed
        ),
    )


def equal_dirichlet_partition(
    labels: NDArray[Any], num_partitions: int, alpha: float, seed: int
) -> Partition:
    """Equal-size clients whose class mixes are drawn from Dir(α) (disjoint)."""
    from flwr_datasets.partitioner import InnerDirichletPartitioner

    _check_count(len(labels), num_partitions, 1)
    sizes = [len(p) for p in np.array_split(np.arange(len(labels)), num_partitions)]
    return _with_flower_partitioner(
        labels,
        num_partitions,
        lambda: InnerDirichletPartitioner(sizes, "label", alpha, seed=seed),
    )


def shard_partition(
    labels: NDArray[Any], num_partitions: int, classes_per_client: int, seed: int
) -> Partition:
    """Each client gets exactly ``classes_per_client`` classes (pathological)."""
    from flwr_datasets.partitioner import PathologicalPartitioner

    num_classes = len(np.unique(labels))
    if not 1 <= classes_per_client <= num_classes:
        raise ValueError(
            f"classes-per-client must be in [1, {num_classes}], "
            f"got {classes_per_client}"
        )
    # client i's first class is i mod C, so every class is used when there are
    # at least C clients; further classes are drawn at random
    mode = "deterministic" if classes_per_client == 1 else "first-deterministic"
    return _with_flower_partitioner(
        labels,
        num_partitions,
        lambda: PathologicalPartitioner(
            num_partitions, "label", classes_per_client, mode, seed=seed
        ),
    )


def delta_sgd_partition(
    labels: NDArray[Any],
    num_partitions: int,
    alpha: float,
    samples_per_client: int,
    seed: int,
) -> Partition:
    """Sample clients as the Δ-SGD code does (``sampling.py``).

    Δ-SGD (Kim et al., arXiv:2306.11201) §4 describes a Dirichlet split
    following Hsu et al. (arXiv:1909.06335); the authors' code
    ``jlylekim/auto-tuned-FL`` implements it as below.

    For each client: q ~ Dir(α·p) with uniform prior p over the classes;
    class counts ``round(samples_per_client·q)`` with the last class taking
    the remainder; each class's samples drawn with replacement. Clients are
    drawn independently, so their data may overlap.
    """
    if not alpha > 0:
        raise ValueError(f"Invalid alpha: {alpha}")
    labels = np.asarray(labels)
    classes = np.unique(labels)
    members = [np.flatnonzero(labels == c) for c in classes]
    rng = np.random.default_rng(seed)
    prior = np.full(len(classes), 1.0 / len(classes))
    parts = []
    for _ in range(num_partitions):
        q = rng.dirichlet(alpha * prior)
        counts = np.round(samples_per_client * q).astype(int)[:-1]
        counts = np.append(counts, max(samples_per_client - counts.sum(), 0))
        drawn = [
            rng.choice(m, size=k, replace=True)
            for m, k in zip(members, counts, strict=True)
            if k > 0
        ]
        parts.append(np.sort(np.concatenate(drawn)).astype(np.int64))
    return parts


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
    return iid_partition(labels, num_partitions, cfg["seed"])


@PARTITIONS.register("dirichlet")
def _dirichlet(
    labels: NDArray[Any], num_partitions: int, cfg: Mapping[str, Any]
) -> Partition:
    return dirichlet_partition(
        labels, num_partitions, cfg["dirichlet-alpha"], cfg["seed"]
    )


@PARTITIONS.register("dirichlet-equal")
def _dirichlet_equal(
    labels: NDArray[Any], num_partitions: int, cfg: Mapping[str, Any]
) -> Partition:
    return equal_dirichlet_partition(
        labels, num_partitions, cfg["dirichlet-alpha"], cfg["seed"]
    )


@PARTITIONS.register("shards")
def _shards(
    labels: NDArray[Any], num_partitions: int, cfg: Mapping[str, Any]
) -> Partition:
    return shard_partition(
        labels, num_partitions, cfg["classes-per-client"], cfg["seed"]
    )


@PARTITIONS.register("delta-sgd")
def _delta_sgd(
    labels: NDArray[Any], num_partitions: int, cfg: Mapping[str, Any]
) -> Partition:
    return delta_sgd_partition(
        labels,
        num_partitions,
        cfg["dirichlet-alpha"],
        cfg["samples-per-client"],
        cfg["seed"],
    )


#: every run-config key a partition scheme may read; all of them key the cache,
#: so a new scheme can never be served another configuration's partition
PARTITION_KEYS = ("dirichlet-alpha", "samples-per-client", "classes-per-client", "seed")


#: Bump when a scheme's output changes for the same inputs (invalidates caches).
CACHE_FORMAT = 1


def cache_dir() -> Path:
    """Where computed partitions are kept between processes.

    ``$FEDADAPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedadapt`` (default
    ``~/.cache/fedadapt``), subfolder ``partitions``.
    """
    root = os.environ.get("FEDADAPT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fedadapt"
    )
    return Path(root) / "partitions"


def _cache_file(
    name: str, labels: bytes, dtype: str, num_partitions: int, params: tuple
) -> Path:
    """Return the cache file of a partition: a hash of everything defining it."""
    try:
        flwr_datasets = metadata.version("flwr-datasets")
    except metadata.PackageNotFoundError:
        flwr_datasets = "none"
    key = hashlib.sha256(labels)
    key.update(
        repr(
            (CACHE_FORMAT, flwr_datasets, name, dtype, num_partitions, params)
        ).encode()
    )
    return cache_dir() / f"{name}-{num_partitions}-{key.hexdigest()[:32]}.npz"


@lru_cache(maxsize=8)
def _cached(
    name: str, labels: bytes, dtype: str, num_partitions: int, params: tuple
) -> tuple[NDArray[np.int64], ...]:
    """Compute a partition once per machine, not once per process.

    In deployment every message starts a new ClientApp process, which would
    otherwise import flwr-datasets (and Hugging Face datasets, seconds) and
    redo the whole partition every round. The file is keyed by the labels,
    the scheme, its parameters and the flwr-datasets version; an unreadable
    or stale file is recomputed, an unwritable folder only costs the speed-up.
    """
    file = _cache_file(name, labels, dtype, num_partitions, params)
    try:
        with np.load(file) as saved:
            if len(saved.files) == num_partitions:
                return tuple(saved[f"arr_{i}"] for i in range(num_partitions))
    except (OSError, KeyError, ValueError, EOFError):
        pass  # absent or damaged: compute it
    array = np.frombuffer(labels, dtype=dtype)
    parts = tuple(PARTITIONS.get(name)(array, num_partitions, dict(params)))
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(file, "wb") as f:
            np.savez(f, *parts)  # arr_0, arr_1, … in client order
    except OSError:
        pass  # read-only home, full disk: work without the cache
    return parts


def client_indices(
    labels: NDArray[Any], num_partitions: int, partition_id: int, cfg: Mapping[str, Any]
) -> NDArray[np.int64]:
    """Return client ``partition_id``'s sample indices (partition cached)."""
    name = cfg["partition"]
    labels = np.ascontiguousarray(labels)
    params = tuple((k, cfg[k]) for k in PARTITION_KEYS)
    parts = _cached(name, labels.tobytes(), str(labels.dtype), num_partitions, params)
    return parts[partition_id]


def partitioned_client_data(
    train: Dataset,
    labels: NDArray[Any],
    cfg: Mapping[str, Any],
    partition_id: int,
    num_partitions: int,
    held_out_from: Dataset | None = None,
) -> ClientData:
    """Return client ``partition_id``'s share of a pooled training set.

    The client's indices (:func:`client_indices`, run-config ``partition``)
    are split into local train and test parts
    (:func:`train_test_split_indices` with ``client-test-fraction`` and seed
    ``seed + partition_id``), the same way for every task that partitions
    one pool. ``held_out_from`` is the dataset the test part is taken from
    (the same samples without augmentation); ``None``: ``train``.
    """
    indices = client_indices(labels, num_partitions, partition_id, cfg)
    local_train, local_test = train_test_split_indices(
        indices, cfg["client-test-fraction"], cfg["seed"] + partition_id
    )
    test = train if held_out_from is None else held_out_from
    return ClientData(
        Subset(train, local_train.tolist()), Subset(test, local_test.tolist())
    )
