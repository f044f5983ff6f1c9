"""A node's data as ready files: written once, memory-mapped by every message.

In deployment Flower starts a new ClientApp process for every message, and a
process's caches die with it: each message would import the dataset's
libraries again (scikit-learn, Hugging Face ``datasets``), read the raw
files, split them and, for ``data-path`` nodes, check every sample. Instead
the first message of a node writes the node's model-ready arrays (train
inputs and labels, held-out inputs and labels) as ``.npy`` files, and later
messages map them into memory (``np.load(mmap_mode="c")``: pages are read
when a batch needs them; the arrays are copy-on-write, so nothing a process
does reaches the file).

A node's folder, ``<cache>/nodes/<name>-<key>`` beside the partition cache
(:func:`~fedadapt.tasks.partition.cache_dir`), is keyed by a hash of
everything that defines the data (:func:`ready_key`): for a partition the
whole run config (task, seed, partitioning, ``client-test-fraction``,
``data-dir``, …) and ``partition-id``/``num-partitions``; for ``data-path``
the path, the task, ``client-test-fraction`` and ``seed``; for both the
names, sizes and modification times of the files under the data folder
(:func:`tree_signature`), the format of the folder and the versions of the
libraries that make the data. Any change gives another folder.

Each array is written atomically (:func:`~fedadapt._atomic.atomic_open`),
then ``meta.json`` naming every array's shape and dtype. A reader takes the
folder only when ``meta.json`` is there and every array matches it; a torn,
truncated or otherwise unreadable folder is ignored and rewritten. Writing
is best effort: a read-only or full cache folder only costs the speed-up.

Folders are not kept for ever: every read marks its folder used (the
modification time of ``meta.json``), and every write removes the folders
not used for :data:`KEEP_DAYS` days (:func:`prune_ready`); a folder that a
process still has mapped keeps its pages until that process lets go.

Only data held as tensors can be written: a ``TensorDataset`` of (inputs,
labels) or a ``Subset`` of one. Anything else (a dataset that augments its
samples as it serves them) is recomputed by every process, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import Dataset, Subset, TensorDataset

from fedadapt._atomic import atomic_open, atomic_write_text
from fedadapt.tasks.base import ClientData
from fedadapt.tasks.partition import cache_dir

#: Bump when the folder's layout or what a key covers changes.
READY_FORMAT = 1

#: the arrays of a node's folder, in ``meta.json``'s order
ARRAYS = ("train_x", "train_y", "test_x", "test_y")

META = "meta.json"

#: A node folder not read or written for this many days is removed by the
#: next write (a run config, data folder or library version no longer used)
KEEP_DAYS = 14.0

#: libraries whose versions may change a task's data for the same inputs
#: (scikit-learn's digits and split, flwr-datasets' partitioners, …)
_DATA_LIBRARIES = ("numpy", "torch", "scikit-learn", "flwr-datasets", "torchvision",
                   "datasets", "mlxtend", "pillow")  # fmt: skip


def ready_dir() -> Path:
    """Where nodes' ready files are kept: ``nodes`` beside ``partitions``."""
    return cache_dir().parent / "nodes"


def _versions() -> dict[str, str]:
    found = {}
    for name in _DATA_LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "none"
    return found


def tree_signature(path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """Return (relative name, size, mtime in ns) of every file under ``path``.

    ``path`` may be a file (one entry, named ``""``) or a folder (walked,
    hidden entries included, sorted); a missing path gives ``[]``.
    """
    root = Path(path)
    try:
        info = root.stat()
    except OSError:
        return []
    if not root.is_dir():
        return [("", info.st_size, info.st_mtime_ns)]
    entries = []
    for folder, _, files in os.walk(root):
        for name in files:
            file = Path(folder, name)
            try:
                info = file.stat()
            except OSError:
                continue  # vanished while walking: not part of the data
            entries.append((str(file.relative_to(root)), info.st_size,
                            info.st_mtime_ns))  # fmt: skip
    return sorted(entries)


def ready_key(what: Mapping[str, Any]) -> str:
    """Return the hex key of a node's data defined by ``what`` (JSON values).

    The folder format and the data libraries' versions are part of it.
    """
    text = json.dumps(
        {"format": READY_FORMAT, "versions": _versions(), "data": what},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def dataset_arrays(dataset: Dataset) -> tuple[NDArray[Any], NDArray[Any]] | None:
    """Return (inputs, labels) of a tensor dataset or a subset of one, else None."""
    rows = None
    if isinstance(dataset, Subset):
        rows = torch.as_tensor(dataset.indices, dtype=torch.int64)
        dataset = dataset.dataset
    if not isinstance(dataset, TensorDataset) or len(dataset.tensors) != 2:
        return None
    x, y = dataset.tensors
    if rows is not None:
        x, y = x[rows], y[rows]
    return x.detach().cpu().numpy(), y.detach().cpu().numpy()


def _tensors(x: NDArray[Any], y: NDArray[Any]) -> TensorDataset:
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def read_ready(folder: Path) -> ClientData | None:
    """Return the node data in ``folder``, or None if it is absent or damaged."""
    try:
        meta = json.loads((folder / META).read_text())
        arrays = {}
        for name in ARRAYS:
            array = np.load(folder / f"{name}.npy", mmap_mode="c", allow_pickle=False)
            want = meta["arrays"][name]
            if list(array.shape) != want["shape"] or str(array.dtype) != want["dtype"]:
                return None
            arrays[name] = array
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None  # absent, torn, truncated or not ours: compute it
    with contextlib.suppress(OSError):  # used now (prune_ready keeps it)
        os.utime(folder / META)
    return ClientData(
        _tensors(arrays["train_x"], arrays["train_y"]),
        _tensors(arrays["test_x"], arrays["test_y"]),
    )


def write_ready(folder: Path, data: ClientData) -> bool:
    """Write ``data`` into ``folder`` (best effort); False if it cannot be.

    False for data not held as tensors and where the folder is not writable.
    """
    train, test = dataset_arrays(data.train), dataset_arrays(data.test)
    if train is None or test is None:
        return False
    arrays = dict(zip(ARRAYS, (*train, *test), strict=True))
    meta = {
        "format": READY_FORMAT,
        "arrays": {
            name: {"shape": list(a.shape), "dtype": str(a.dtype)}
            for name, a in arrays.items()
        },
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (folder / META).unlink()  # a rewrite: no reader takes a half-new folder
        for name, array in arrays.items():
            with atomic_open(folder / f"{name}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        atomic_write_text(folder / META, json.dumps(meta, indent=1))
    except OSError:
        return False  # read-only home, full disk: work without the files
    prune_ready(folder.parent, keep=folder)
    return True


def prune_ready(
    root: Path, keep: Path | None = None, days: float = KEEP_DAYS
) -> list[Path]:
    """Remove the node folders under ``root`` unused for ``days``; return them.

    A folder's last use is the modification time of its ``meta.json`` (a
    read touches it), else of the folder itself (one being written has no
    ``meta.json`` yet and a fresh folder time). ``keep`` is never removed.
    Best effort: a folder that cannot be removed is left.
    """
    import shutil

    cutoff = time.time() - days * 86400
    removed: list[Path] = []
    try:
        folders = [f for f in root.iterdir() if f.is_dir() and f != keep]
    except OSError:
        return removed
    for folder in folders:
        try:
            meta = folder / META
            used = (meta if meta.exists() else folder).stat().st_mtime
        except OSError:
            continue
        if used < cutoff:
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
    return removed


def ready_client_data(
    name: str, what: Mapping[str, Any], compute: Callable[[], ClientData]
) -> ClientData:
    """Return a node's data from its ready files, computing and writing them once.

    ``name`` begins the folder's name (for people reading the cache);
    ``what`` (JSON values) defines the data (:func:`ready_key`); ``compute``
    makes it when no intact folder exists. The data read back has the
    values ``compute`` gives, in the same order, as tensor datasets.
    """
    folder = ready_dir() / f"{name}-{ready_key(what)}"
    found = read_ready(folder)
    if found is not None:
        return found
    data = compute()
    write_ready(folder, data)
    return data
