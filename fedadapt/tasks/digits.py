"""scikit-learn's bundled handwritten digits: the offline default task.

1,797 8×8 images of 10 digits ship inside scikit-learn, so this task needs no
download. A fixed stratified 20 % is the global test set; the remaining 80 %
is split over the clients by run-config ``partition``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedadapt.tasks.base import ClientData, DataSpec, Task
from fedadapt.tasks.models import MLP
from fedadapt.tasks.partition import partitioned_client_data

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the global test set is the same whatever the run's seed


@lru_cache(maxsize=1)
def load_digits_split() -> tuple[TensorDataset, TensorDataset]:
    """Return the (train, test) split of the digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    as_set = lambda a, b: TensorDataset(torch.from_numpy(a), torch.from_numpy(b))  # noqa: E731
    return as_set(x_tr, y_tr), as_set(x_te, y_te)


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
