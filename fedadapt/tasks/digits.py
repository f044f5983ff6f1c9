"""scikit-learn's bundled handwritten digits: the offline default task.

1,797 8×8 images of 10 digits ship inside scikit-learn, so this task needs no
download. A fixed stratified 20 % is the global test set; the remaining 80 %
is split over the clients by run-config ``partition``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedadapt._atomic import atomic_open
from fedadapt.tasks.base import ClientData, DataSpec, Task
from fedadapt.tasks.models import MLP
from fedadapt.tasks.partition import cache_dir, partitioned_client_data

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the global test set is the same whatever the run's seed


#: The 1,797 digits: 1,437 to train, 360 to test.
SPLIT_SIZES = (1437, 360)


@lru_cache(maxsize=1)
def load_digits_split() -> tuple[TensorDataset, TensorDataset]:
    """Return the (train, test) split of the digits, pixels scaled to [0, 1].

    Computed with scikit-learn once per machine and version, then read from
    the cache folder (:func:`_split_file`): importing scikit-learn costs each
    process that needs the digits 1.3–3 s on 2 cores (a run's ServerApp and
    every simulated client's first message, issue #39's start-up), reading
    the 0.5-MB file a few milliseconds.
    """
    as_set = lambda a, b: TensorDataset(torch.from_numpy(a), torch.from_numpy(b))  # noqa: E731
    path = _split_file()
    try:
        with np.load(path) as saved:
            arrays = [saved[k] for k in ("x_train", "y_train", "x_test", "y_test")]
        if (len(arrays[0]), len(arrays[2])) == SPLIT_SIZES:
            return as_set(*arrays[:2]), as_set(*arrays[2:])
    except (OSError, ValueError, KeyError):  # none yet, or unreadable: make it
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as f:
            np.savez(f, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
    except OSError:  # a read-only cache: compute again next time
        pass
    return as_set(x_tr, y_tr), as_set(x_te, y_te)


def _split_file() -> Path:
    """Return the cached split's path, named by what defines it (scikit-learn too)."""
    try:
        version = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        version = "none"
    return (
        cache_dir() / f"digits-split-{TEST_FRACTION}-{SPLIT_SEED}-sklearn{version}.npz"
    )


def load_client(
    cfg: Mapping[str, Any], partition_id: int, num_partitions: int
) -> ClientData:
    """Return client ``partition_id``'s local train/test data."""
    train, _ = load_digits_split()
    return partitioned_client_data(
        train, train.tensors[1].numpy(), cfg, partition_id, num_partitions
    )


DIGITS_MLP = Task(
    name="digits-mlp",
    summary="scikit-learn digits (8×8, 10 classes), MLP 64→64→10; offline default",
    build_model=lambda: MLP(64, 64, 10),
    load_client=load_client,
    load_test=lambda cfg: load_digits_split()[1],
    # 8×8 grey images, pixels 0..16 scaled to [0, 1] (an 8-bit image's /255
    # is the same scale), flattened to the MLP's 64 inputs
    data_spec=DataSpec((64,), 10, (8, 8, 1), pool=lambda cfg: load_digits_split()[0]),
)
