"""Real datasets read from a local data directory: never downloaded here.

Everything reads files that already lie under run-config ``data-dir``; no
function in this module touches the network. Two families are supported.

torchvision image datasets (:func:`load_torchvision`)
    ``"mnist"``, ``"fmnist"``, ``"cifar10"`` and ``"cifar100"`` through
    ``torchvision.datasets`` with ``download=False``, in the standard on-disk
    layouts that torchvision's own ``download=True`` produces::

        <data-dir>/MNIST/raw/train-images-idx3-ubyte          (and 3 more)
        <data-dir>/FashionMNIST/raw/train-images-idx3-ubyte   (and 3 more)
        <data-dir>/cifar-10-batches-py/data_batch_1 … data_batch_5,
                                       test_batch, batches.meta
        <data-dir>/cifar-100-python/train, test, meta

    Images come out as normalised float tensors (as in the Δ-SGD authors' code):
    MNIST/FMNIST ``Normalize((0.1307,), (0.3081,))``; CIFAR per-dataset
    channel mean/std, optionally after ``RandomCrop(32, padding=4)`` and
    ``RandomHorizontalFlip()`` on the training split (``augment=True``).
    :func:`labels_of` returns any such dataset's labels as a NumPy array
    without decoding an image, for the partitioners.

LEAF JSON datasets (:func:`load_leaf`)
    ``"femnist"`` and ``"shakespeare"`` with their natural clients (writers,
    speaking roles), from LEAF's ``<data-dir>/<name>/data/{train,test}/*.json``.

    - FEMNIST: ``x`` is ``float32`` of shape ``(n, 1, 28, 28)`` (LEAF's 784
      values in ``[0, 1]``, used as LEAF stores them), ``y`` is ``int64`` in
      ``0..61``.
    - Shakespeare: ``x`` is ``int64`` of shape ``(n, 80)`` (character indices
      in :data:`SHAKESPEARE_VOCAB`), ``y`` is ``int64`` of shape ``(n,)``, the
      index of the next character.

    Users are sorted by id, so client ``i`` is the same writer on every
    machine: :func:`leaf_users`, :func:`leaf_client_data`,
    :func:`leaf_test_dataset`.

Missing files raise :class:`DatasetMissingError` (a ``FileNotFoundError``)
naming the expected files and how to obtain them.

Integrity checks
----------------
torchvision's CIFAR classes compare the MD5 of every batch file (about 180 MB)
with the published checksum each time a dataset object is built, and refuse
files that differ. Here the CIFAR classes are subclassed with the checksums
removed, so only the files' *existence* is checked on load: the files are the
user's, torchvision already verified them when it downloaded them, and
re-hashing them on every client load is slow. Pass ``verify_checksums=True``
to :func:`load_torchvision` to compare them with torchvision's published MD5s
once. torchvision keeps no checksums for MNIST's extracted ``raw`` files (only
for the ``.gz`` downloads), so MNIST/FMNIST are checked for existence only.

Flower Datasets
---------------
:func:`flwr_federated_dataset` builds a ``flwr_datasets.FederatedDataset``
(Hugging Face hub, needs internet and ``pip install flwr-datasets``) for users
who prefer it; it is never used by the tasks or the tests.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

__all__ = [
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "FEMNIST_NUM_CLASSES",
    "FLWR_DATASET_IDS",
    "LEAF_DATASETS",
    "MNIST_MEAN",
    "MNIST_STD",
    "SHAKESPEARE_SEQ_LEN",
    "SHAKESPEARE_VOCAB",
    "SHAKESPEARE_VOCAB_SIZE",
    "TORCHVISION_DATASETS",
    "DatasetCorruptError",
    "DatasetMissingError",
    "expected_files",
    "flwr_federated_dataset",
    "image_transform",
    "labels_of",
    "leaf_client_data",
    "leaf_test_dataset",
    "leaf_users",
    "load_leaf",
    "load_torchvision",
    "shakespeare_decode",
    "shakespeare_encode",
]

# ---------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------

TORCHVISION_DATASETS = ("mnist", "fmnist", "cifar10", "cifar100")
LEAF_DATASETS = ("femnist", "shakespeare")

_ALIASES = {
    "fashion-mnist": "fmnist",
    "fashion_mnist": "fmnist",
    "fashionmnist": "fmnist",
    "cifar-10": "cifar10",
    "cifar-100": "cifar100",
}

MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)
# Per-channel statistics of the respective training sets (RGB, pixels in [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

FEMNIST_NUM_CLASSES = 62

SHAKESPEARE_VOCAB = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
"""LEAF's ``ALL_LETTERS``: character ``c`` is encoded as its index here."""

SHAKESPEARE_VOCAB_SIZE = len(SHAKESPEARE_VOCAB)
"""80, LEAF's vocabulary. FedDuA's App. Table 4 says 79 (one short); a model that
embeds these indices needs at least 80 rows, see :func:`shakespeare_encode`."""

SHAKESPEARE_SEQ_LEN = 80

assert SHAKESPEARE_VOCAB_SIZE == 80, SHAKESPEARE_VOCAB_SIZE
assert len(set(SHAKESPEARE_VOCAB)) == SHAKESPEARE_VOCAB_SIZE

_CHAR_TO_INDEX = {c: i for i, c in enumerate(SHAKESPEARE_VOCAB)}

# Hugging Face dataset ids used by flwr_datasets for each name.
FLWR_DATASET_IDS = {
    "mnist": "ylecun/mnist",
    "fmnist": "zalando-datasets/fashion_mnist",
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "femnist": "flwrlabs/femnist",
    "shakespeare": "flwrlabs/shakespeare",
}
_FLWR_NATURAL_ID = {"femnist": "writer_id", "shakespeare": "character_id"}


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class DatasetMissingError(FileNotFoundError):
    """A dataset's files are not in the data directory.

    The message lists the expected paths and how to obtain the files.
    """


class DatasetCorruptError(ValueError):
    """A dataset file is damaged: unreadable, truncated, or off its checksum.

    The message names the file(s), run-config ``data-dir`` and what to do.
    """


def _normalise_name(name: str, allowed: tuple[str, ...]) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in allowed:
        raise ValueError(f"Unknown dataset {name!r}; expected one of {allowed}")
    return key


# ---------------------------------------------------------------------------
# torchvision datasets
# ---------------------------------------------------------------------------

_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_TV_FOLDER = {
    "mnist": "MNIST",
    "fmnist": "FashionMNIST",
    "cifar10": "cifar-10-batches-py",
    "cifar100": "cifar-100-python",
}
_TV_CLASS = {
    "mnist": "MNIST",
    "fmnist": "FashionMNIST",
    "cifar10": "CIFAR10",
    "cifar100": "CIFAR100",
}


def _cifar_files(name: str) -> list[tuple[str, str]]:
    """Return ``(filename, md5)`` of every file torchvision reads for CIFAR."""
    from torchvision import datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    files = [(f, md5) for f, md5 in cls.train_list + cls.test_list]
    return files + [(cls.meta["filename"], cls.meta["md5"])]


def expected_files(name: str, data_dir: Path | str) -> list[Path]:
    """Return the files a dataset needs under ``data_dir``.

    Parameters
    ----------
    name : str
        One of :data:`TORCHVISION_DATASETS` or :data:`LEAF_DATASETS`.
    data_dir : Path or str
        Run-config ``data-dir``.

    Returns
    -------
    list of Path
        For LEAF datasets, the two split folders that must hold ``*.json``.
    """
    root = Path(data_dir)
    key = _normalise_name(name, TORCHVISION_DATASETS + LEAF_DATASETS)
    if key in LEAF_DATASETS:
        return [_leaf_split_dir(root, key, s) for s in ("train", "test")]
    folder = root / _TV_FOLDER[key]
    if key in ("mnist", "fmnist"):
        return [folder / "raw" / f for f in _MNIST_FILES]
    return [folder / f for f, _ in _cifar_files(key)]


def _how_to_get(name: str, data_dir: Path) -> str:
    if name in LEAF_DATASETS:
        return (
            "Generate it with LEAF (https://github.com/TalwalkarLab/leaf), e.g. "
            f"`cd leaf/data/{name} && ./preprocess.sh -s niid --sf 1.0 -k 0 -t "
            f"sample`, then copy leaf/data/{name}/data/train and .../test to "
            f"{data_dir / name / 'data'}."
        )
    cls = _TV_CLASS[name]
    return (
        "Download it once on a machine with internet access, e.g.\n"
        f'    python -c "import torchvision; torchvision.datasets.{cls}('
        f"root='{data_dir}', download=True)\"\n"
        "(torchvision fetches the official archives and verifies their MD5), "
        "or unpack the official archive "
        + (
            "(https://www.cs.toronto.edu/~kriz/cifar.html) "
            if name.startswith("cifar")
            else f"(the four idx .gz files from {_mnist_mirror(name)}, gunzipped) "
        )
        + "into that layout."
    )


def _mnist_mirror(name: str) -> str:
    from torchvision import datasets as tvd

    return getattr(tvd, _TV_CLASS[name]).mirrors[0]


def _missing_error(name: str, data_dir: Path, missing: list[Path]) -> Exception:
    expected = "\n".join(f"    {p}" for p in expected_files(name, data_dir))
    absent = "\n".join(f"    {p}" for p in missing)
    return DatasetMissingError(
        f"Dataset {name!r} not found under data-dir {str(data_dir)!r}.\n"
        f"Missing:\n{absent}\nExpected layout:\n{expected}\n"
        f"{_how_to_get(name, data_dir)}\n"
        "Nothing is downloaded at run time; set run-config data-dir to the "
        "folder that holds the data."
    )


def _mnist_legacy_exists(folder: Path) -> bool:
    processed = folder / "processed"
    return all((processed / f).is_file() for f in ("training.pt", "test.pt"))


def _check_present(name: str, root: Path) -> None:
    if name in ("mnist", "fmnist") and _mnist_legacy_exists(root / _TV_FOLDER[name]):
        return  # torchvision < 0.8's processed tensors, still read by torchvision
    missing = [p for p in expected_files(name, root) if not p.is_file()]
    if missing:
        raise _missing_error(name, root, missing)


def _verify_checksums(name: str, root: Path) -> None:
    if name not in ("cifar10", "cifar100"):
        return  # torchvision records no checksum for MNIST's extracted files
    from torchvision.datasets.utils import check_md5

    folder = root / _TV_FOLDER[name]
    bad = [f for f, md5 in _cifar_files(name) if not check_md5(folder / f, md5)]
    if bad:
        raise DatasetCorruptError(
            f"{name}: these files under {folder} differ from the published MD5 "
            f"checksums: {bad}. Re-download or re-extract them."
        )


@cache
def _unverified_cifar(name: str) -> type:
    """Return torchvision's CIFAR class with MD5 checks reduced to existence.

    torchvision's ``check_integrity(path, md5=None)`` only tests that the file
    exists, so blanking the checksums keeps every other behaviour (file list,
    pickle keys, ``classes``) exactly torchvision's. ``download`` is disabled.
    """
    from torchvision import datasets as tvd

    base = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100

    def download(self: Any) -> None:
        raise RuntimeError("fedadapt never downloads datasets")

    return type(
        f"Unverified{base.__name__}",
        (base,),
        {
            "__doc__": f"{base.__name__} that checks file existence, not MD5.",
            "__module__": __name__,
            "train_list": [[f, None] for f, _ in base.train_list],
            "test_list": [[f, None] for f, _ in base.test_list],
            "meta": {**base.meta, "md5": None},
            "download": download,
        },
    )


def image_transform(name: str, train: bool = True, augment: bool = False) -> Callable:
    """Return the standard torchvision transform for a dataset.

    Parameters
    ----------
    name : str
        One of :data:`TORCHVISION_DATASETS`.
    train : bool
        Whether the transform is for the training split; augmentation only
        ever applies there.
    augment : bool
        CIFAR only: ``RandomCrop(32, padding=4)`` and ``RandomHorizontalFlip()``
        before normalisation (Δ-SGD authors' code). Ignored for MNIST/FMNIST,
        which the papers train without augmentation.

    Returns
    -------
    Callable
        PIL image → normalised ``float32`` tensor of shape ``(C, H, W)``.
    """
    from torchvision import transforms as T

    key = _normalise_name(name, TORCHVISION_DATASETS)
    if key in ("mnist", "fmnist"):
        return T.Compose([T.ToTensor(), T.Normalize(MNIST_MEAN, MNIST_STD)])
    mean, std = (
        (CIFAR10_MEAN, CIFAR10_STD)
        if key == "cifar10"
        else (CIFAR100_MEAN, CIFAR100_STD)
    )
    steps: list[Callable] = []
    if train and augment:
        steps += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


def load_torchvision(
    name: str,
    data_dir: Path | str,
    train: bool = True,
    augment: bool = False,
    *,
    verify_checksums: bool = False,
    transform: Callable | None = None,
) -> Dataset:
    """Load MNIST, Fashion-MNIST, CIFAR-10 or CIFAR-100 from disk.

    Parameters
    ----------
    name : str
        ``"mnist"``, ``"fmnist"`` (also ``"fashion-mnist"``), ``"cifar10"`` or
        ``"cifar100"``.
    data_dir : Path or str
        The folder torchvision's ``root`` points at (run-config ``data-dir``).
    train : bool
        Training split if true, else the test split.
    augment : bool
        See :func:`image_transform`.
    verify_checksums : bool
        CIFAR only: also compare every file with torchvision's published MD5
        (hashes about 180 MB). Off by default; see the module docstring.
    transform : Callable, optional
        Replaces :func:`image_transform`'s standard transform.

    Returns
    -------
    torch.utils.data.Dataset
        The torchvision dataset; items are ``(image_tensor, int_label)`` and
        ``labels_of(dataset)`` gives all labels.

    Raises
    ------
    DatasetMissingError
        If any file is missing; the message names the expected layout.
    DatasetCorruptError
        If ``verify_checksums`` and a file's MD5 differs.
    ValueError
        If ``name`` is not a supported dataset.
    """
    from torchvision import datasets as tvd

    key = _normalise_name(name, TORCHVISION_DATASETS)
    root = Path(data_dir)
    _check_present(key, root)
    if verify_checksums:
        _verify_checksums(key, root)
    tf = transform if transform is not None else image_transform(key, train, augment)
    if key in ("mnist", "fmnist"):
        cls = tvd.MNIST if key == "mnist" else tvd.FashionMNIST
    else:
        cls = _unverified_cifar(key)
    try:
        return cls(root=str(root), train=train, transform=tf, download=False)
    except Exception as error:  # torchvision's bare asserts, pickle/EOF errors
        raise _corrupt_error(key, root, train, error) from error


#: IDX element type byte -> bytes per element (LeCun's format, as torchvision)
_IDX_ITEM_SIZE = {0x08: 1, 0x09: 1, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8}


def idx_problem(path: Path) -> str | None:
    """Return what is wrong with an IDX file (MNIST's format), or None.

    Checks the header (two zero bytes, element type, 1-3 dimensions) and that
    the file size is the header's plus the data the dimensions promise.
    """
    try:
        with path.open("rb") as f:
            head = f.read(4)
            size = path.stat().st_size
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in _IDX_ITEM_SIZE:
                return "not an IDX file (bad magic number)"
            ndim = head[3]
            if not 1 <= ndim <= 3:
                return f"not an IDX file ({ndim} dimensions)"
            dims_raw = f.read(4 * ndim)
    except OSError as error:
        return f"unreadable ({error.strerror or error})"
    if len(dims_raw) < 4 * ndim:
        return f"truncated header ({size} bytes)"
    dims = [int.from_bytes(dims_raw[4 * i : 4 * i + 4], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + int(np.prod(dims)) * _IDX_ITEM_SIZE[head[2]]
    if size != expected:
        shape = "×".join(map(str, dims))
        return f"{size} bytes, but its header ({shape}) needs {expected}"
    return None


def _split_files(key: str, root: Path, train: bool) -> list[Path]:
    """Return the files torchvision reads for one split of a dataset."""
    if key in ("mnist", "fmnist"):
        prefix = "train" if train else "t10k"
        return [p for p in expected_files(key, root) if p.name.startswith(prefix)]
    from torchvision import datasets as tvd

    cls = tvd.CIFAR10 if key == "cifar10" else tvd.CIFAR100
    names = [f for f, _ in (cls.train_list if train else cls.test_list)]
    folder = root / _TV_FOLDER[key]
    return [folder / f for f in [*names, cls.meta["filename"]]]


def _corrupt_error(
    key: str, root: Path, train: bool, error: Exception
) -> DatasetCorruptError:
    """Name the damaged file(s) of a split that torchvision failed to read."""
    files = _split_files(key, root, train)
    named = files
    if key in ("mnist", "fmnist"):
        found = {p: idx_problem(p) for p in files}
        if any(found.values()):
            named = [p for p, problem in found.items() if problem]
        details = "; ".join(f"{p}: {found[p] or 'unreadable'}" for p in named)
    else:
        details = ", ".join(map(str, named))
    cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return DatasetCorruptError(
        f"Dataset {key!r} under data-dir {str(root)!r} is damaged ({cause}): "
        f"{details}. Delete the damaged file(s) and fetch them again, or set "
        f"run-config data-dir to a folder with intact files.\n"
        f"{_how_to_get(key, root)}"
    )


def labels_of(dataset: Dataset) -> NDArray[np.int64]:
    """Return every label of a dataset as an ``int64`` array, without images.

    Parameters
    ----------
    dataset : Dataset
        A torchvision dataset with ``targets`` (list or tensor), a
        ``TensorDataset`` whose last tensor holds the labels, or a ``Subset``
        / ``ConcatDataset`` of those.

    Returns
    -------
    numpy.ndarray
        Labels in dataset order.

    Raises
    ------
    TypeError
        If the labels cannot be read without iterating over the data.
    """
    if isinstance(dataset, Subset):
        return labels_of(dataset.dataset)[np.asarray(dataset.indices, dtype=np.int64)]
    if isinstance(dataset, ConcatDataset):
        parts = [labels_of(d) for d in dataset.datasets]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if isinstance(dataset, TensorDataset):
        return _as_int64(dataset.tensors[-1])
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return _as_int64(targets)
    raise TypeError(
        f"Cannot read labels of {type(dataset).__name__} cheaply; give it a "
        "`targets` attribute or wrap the data in a TensorDataset"
    )


def _as_int64(values: Any) -> NDArray[np.int64]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


# ---------------------------------------------------------------------------
# LEAF datasets
# ---------------------------------------------------------------------------

LeafData = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _leaf_split_dir(root: Path, name: str, split: str) -> Path:
    return root / name / "data" / split


def shakespeare_encode(text: str) -> list[int]:
    """Map characters to indices in :data:`SHAKESPEARE_VOCAB` (LEAF's mapping).

    Raises
    ------
    ValueError
        For a character outside the vocabulary (LEAF would silently give -1).
    """
    try:
        return [_CHAR_TO_INDEX[c] for c in text]
    except KeyError:
        unknown = sorted({c for c in text if c not in _CHAR_TO_INDEX})
        raise ValueError(
            f"Characters {unknown!r} are not in LEAF's Shakespeare vocabulary"
        ) from None


def shakespeare_decode(indices: Any) -> str:
    """Map vocabulary indices back to the text; inverse of the encoder."""
    return "".join(SHAKESPEARE_VOCAB[int(i)] for i in indices)


def _leaf_json_files(root: Path, name: str, split: str) -> list[Path]:
    folder = _leaf_split_dir(root, name, split)
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise _missing_error(name, root, [folder / "*.json"])
    return files


def _to_tensors(
    name: str, user: str, x: list, y: list
) -> tuple[torch.Tensor, torch.Tensor]:
    if len(x) != len(y):
        raise ValueError(f"{name} user {user!r}: {len(x)} inputs but {len(y)} labels")
    if name == "femnist":
        xs = torch.tensor(np.asarray(x, dtype=np.float32).reshape(-1, 1, 28, 28))
        ys = torch.tensor(np.asarray(y, dtype=np.int64).reshape(-1))
        if ys.numel() and (ys.min() < 0 or ys.max() >= FEMNIST_NUM_CLASSES):
            raise ValueError(f"femnist user {user!r}: labels outside 0..61")
        return xs, ys
    lengths = {len(s) for s in x}
    if len(lengths) > 1:
        raise ValueError(f"shakespeare user {user!r}: sequences of lengths {lengths}")
    if any(len(c) != 1 for c in y):
        raise ValueError(f"shakespeare user {user!r}: each label must be 1 character")
    width = lengths.pop() if lengths else SHAKESPEARE_SEQ_LEN
    xs = torch.tensor([shakespeare_encode(s) for s in x], dtype=torch.int64)
    ys = torch.tensor(shakespeare_encode("".join(y)), dtype=torch.int64)
    return xs.reshape(-1, width), ys


def _file_signature(files: list[Path]) -> tuple[tuple[str, int, int], ...]:
    return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)


@lru_cache(maxsize=4)
def _load_leaf_cached(
    root: str, name: str, split: str, signature: tuple[tuple[str, int, int], ...]
) -> LeafData:
    del signature  # part of the cache key only: edited files are re-read
    user_data: dict[str, Mapping[str, list]] = {}
    for path in _leaf_json_files(Path(root), name, split):
        with open(path, encoding="utf-8") as fh:
            blob = json.load(fh)
        try:
            chunk = blob["user_data"]
        except (KeyError, TypeError):
            raise ValueError(f"{path} is not a LEAF file: no 'user_data'") from None
        for user, data in chunk.items():
            if user in user_data:
                raise ValueError(f"{name}/{split}: user {user!r} appears twice")
            user_data[user] = data
    return {
        user: _to_tensors(name, user, user_data[user]["x"], user_data[user]["y"])
        for user in sorted(user_data)
    }


def load_leaf(data_dir: Path | str, name: str, split: str = "train") -> LeafData:
    """Read one split of a LEAF dataset, one entry per natural client.

    Every ``*.json`` under ``<data_dir>/<name>/data/<split>/`` is read (in file
    name order) and the users merged. Results are cached per process (up to 4
    splits) and re-read when a file changes; treat the tensors as read-only.

    Parameters
    ----------
    data_dir : Path or str
        Run-config ``data-dir``.
    name : str
        ``"femnist"`` or ``"shakespeare"``.
    split : str
        ``"train"`` or ``"test"``.

    Returns
    -------
    dict of str to (torch.Tensor, torch.Tensor)
        ``user_id → (x, y)``, in sorted user-id order; shapes and dtypes are in
        the module docstring.

    Raises
    ------
    DatasetMissingError
        If the split folder holds no ``*.json``.
    ValueError
        For an unknown name or split, or malformed data.
    """
    key = _normalise_name(name, LEAF_DATASETS)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(data_dir)
    files = _leaf_json_files(root, key, split)
    return _load_leaf_cached(os.fspath(root), key, split, _file_signature(files))


def leaf_users(data_dir: Path | str, name: str, split: str = "train") -> list[str]:
    """Return the sorted user ids of a LEAF split; client ``i`` is entry ``i``."""
    return list(load_leaf(data_dir, name, split))


def _empty_like(name: str) -> TensorDataset:
    if _normalise_name(name, LEAF_DATASETS) == "femnist":
        x = torch.zeros(0, 1, 28, 28)
    else:
        x = torch.zeros(0, SHAKESPEARE_SEQ_LEN, dtype=torch.int64)
    return TensorDataset(x, torch.zeros(0, dtype=torch.int64))


def leaf_client_data(
    data_dir: Path | str, name: str, client_index: int
) -> tuple[TensorDataset, TensorDataset]:
    """Return natural client ``client_index``'s (train, test) datasets.

    The client is ``leaf_users(data_dir, name)[client_index]``. Its test data
    is the same user's entry in the test split; with LEAF's by-user split
    (``-t user``) the user has none and the test set is empty.

    Raises
    ------
    IndexError
        If ``client_index`` is outside ``range(len(leaf_users(...)))``.
    """
    train = load_leaf(data_dir, name, "train")
    users = list(train)
    if not 0 <= client_index < len(users):
        raise IndexError(
            f"{name} has {len(users)} training users; client_index {client_index} "
            "is out of range"
        )
    user = users[client_index]
    test = load_leaf(data_dir, name, "test")
    test_ds = TensorDataset(*test[user]) if user in test else _empty_like(name)
    return TensorDataset(*train[user]), test_ds


def leaf_test_dataset(data_dir: Path | str, name: str) -> TensorDataset:
    """Return every user's test data in one dataset (global evaluation)."""
    test = load_leaf(data_dir, name, "test")
    if not test:
        return _empty_like(name)
    xs, ys = zip(*test.values(), strict=True)
    return TensorDataset(torch.cat(xs), torch.cat(ys))


# ---------------------------------------------------------------------------
# Flower Datasets (optional, online)
# ---------------------------------------------------------------------------


def flwr_federated_dataset(
    name: str,
    num_partitions: int | None = None,
    *,
    partitioner: Any = None,
    **kwargs: Any,
) -> Any:
    """Build a ``flwr_datasets.FederatedDataset`` from the Hugging Face hub.

    An alternative for users with internet access; ``flwr_datasets`` is
    imported only here and this function downloads (through Hugging Face) on
    first use. Nothing else in fedadapt calls it.

    Parameters
    ----------
    name : str
        A key of :data:`FLWR_DATASET_IDS`, or any Hugging Face dataset id.
    num_partitions : int, optional
        With no ``partitioner``: IID partitions of the train split. Ignored for
        FEMNIST and Shakespeare, which are split by natural id (writer,
        character) by default.
    partitioner : flwr_datasets.partitioner.Partitioner, optional
        Partitioner for the ``"train"`` split.
    **kwargs
        Passed on to ``FederatedDataset``.

    Returns
    -------
    flwr_datasets.FederatedDataset

    Raises
    ------
    ImportError
        If ``flwr_datasets`` is not installed.
    """
    try:
        flwr_datasets = importlib.import_module("flwr_datasets")
        partitioners = importlib.import_module("flwr_datasets.partitioner")
    except ImportError as err:
        raise ImportError(
            "flwr_federated_dataset needs Flower Datasets and internet access: "
            "pip install flwr-datasets[vision]. Offline, use load_torchvision / "
            "load_leaf with files in data-dir instead."
        ) from err
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    dataset_id = FLWR_DATASET_IDS.get(key, name)
    if partitioner is None:
        if key in _FLWR_NATURAL_ID:
            partitioner = partitioners.NaturalIdPartitioner(
                partition_by=_FLWR_NATURAL_ID[key]
            )
        elif num_partitions is None:
            raise ValueError("give num_partitions or a partitioner")
        else:
            partitioner = partitioners.IidPartitioner(num_partitions=num_partitions)
    return flwr_datasets.FederatedDataset(
        dataset=dataset_id, partitioners={"train": partitioner}, **kwargs
    )
