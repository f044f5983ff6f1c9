"""A node's own data on disk: read it, check it against the task, write demos.

In a real deployment each site holds its own files and the server none. A
SuperNode started with ``--node-config 'data-path="<path>"'`` (a TOML string:
:func:`fedadapt.tools.deploy.local.data_path_node_config`) trains and
evaluates on that data instead of rebuilding a partition of the task's
public dataset from ``partition-id`` (:func:`load_node_data`). Three on-disk
formats are read, recognised from the path:

Hugging Face ``save_to_disk`` (what ``flwr-datasets create`` writes)
    A folder with ``state.json`` (one ``Dataset``) or ``dataset_dict.json``
    (a ``DatasetDict``). The label column is ``label`` (or the one
    ``ClassLabel`` column); the input is the one ``Image`` column, else a
    column ``x`` of model-ready arrays.
image folder
    ``<path>/<class>/<image>``: one subfolder per class, named by the
    class's integer label (``0``, ``1``, …: a node may lack classes, so
    folder names, not their sorted order, give the labels); PNG, JPEG, BMP
    or any image PIL reads.
npz
    A ``.npz`` file with ``x`` (model-ready inputs, floating point, shape
    ``(n, *input_shape)``) and ``y`` (integer labels).

Images are turned into model inputs as the task's own pipeline does
(:class:`DataSpec`: pixels / 255, the task's normalisation, its shape).

The node's held-out split for federated evaluation is the saved dataset's
``test`` split when it has one (``DatasetDict`` key ``test``; ``test/``
next to ``train/`` in an image folder; ``x_test``/``y_test`` in the npz),
else a deterministic split of the node's own data: run-config
``client-test-fraction`` of it, drawn with run-config ``seed``
(:func:`~fedadapt.tasks.partition.train_test_split_indices`), the same on
every load.

The task fixes the model, so every sample is checked at load (input
shape, dtype, label range and class count); anything that does not fit
raises :class:`NodeDataError` naming the path and the problem in one line.
Loaded data is cached per process and, for deployments' one-message
processes, as ready files (:func:`load_node_data`).

:func:`write_node_datasets` writes N node datasets from a task's data with
a run config's partitioner (``fedadapt make-node-data``), atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import Dataset, Subset, TensorDataset

from fedadapt.strategies import wire
from fedadapt.tasks.base import ClientData, DataSpec, Task
from fedadapt.tasks.partition import (
    PARTITIONS,
    train_test_split_indices,
)
from fedadapt.tasks.ready_data import ready_client_data, tree_signature

#: the node-config key that points a SuperNode at its own data (Flower's
#: convention for deployments, as ``flwr-datasets create`` documents it)
DATA_PATH = wire.DATA_PATH

FORMATS = ("hf", "npz", "imagefolder")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class NodeDataError(ValueError):
    """A node's data is missing, unreadable or does not fit the task."""

    def __init__(
        self, path: str | Path, problem: str, node: int | str | None = None
    ) -> None:
        self.path, self.problem, self.node = str(path), problem, node
        who = "" if node is None else f"node {node} "
        super().__init__(f"{who}data-path {path}: {problem}")

    def __reduce__(
        self,
    ) -> tuple[type[NodeDataError], tuple[str, str, int | str | None]]:
        """Pickle by the constructor's arguments (a node's worker sends it back)."""
        return (type(self), (self.path, self.problem, self.node))


@dataclass(frozen=True)
class Arrays:
    """Model-ready samples of one split: float32 inputs, int64 labels."""

    x: NDArray[np.float32]
    y: NDArray[np.int64]


# --- reading ------------------------------------------------------------------


#: the file an npz node's folder holds (``fedadapt make-node-data`` writes it):
#: data-path may name the file or its folder, so one mount point (``/data``)
#: serves every format in containers
NPZ_NAME = "data.npz"


def detect_format(path: Path) -> str:
    """Return ``hf``, ``npz`` or ``imagefolder`` for ``path`` (NodeDataError)."""
    if not path.exists():
        raise NodeDataError(path, "no such file or folder")
    if path.is_file():
        if path.suffix == ".npz":
            return "npz"
        raise NodeDataError(
            path, "a file that is not .npz; expected an npz file (x, y), a "
            "Hugging Face save_to_disk folder or an image folder",
        )  # fmt: skip
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return "hf"
    if (path / NPZ_NAME).is_file():  # make-node-data's npz node: <node>/data.npz
        return "npz"
    if any(p.is_dir() for p in path.iterdir()):
        return "imagefolder"
    raise NodeDataError(
        path, "neither a Hugging Face save_to_disk folder (state.json or "
        "dataset_dict.json) nor an image folder (one subfolder per class)",
    )  # fmt: skip


def image_to_input(image: NDArray[Any], spec: DataSpec, where: str) -> NDArray:
    """Return one image (H, W) or (H, W, C) as the model's float32 input."""
    height, width, channels = spec.image_shape
    pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.ndim != 3 or pixels.shape != (height, width, channels):
        got = "×".join(map(str, pixels.shape))
        raise ValueError(
            f"{where}: image is {got} (H×W×C), the task expects "
            f"{height}×{width}×{channels}"
        )
    if pixels.dtype != np.uint8:
        raise ValueError(f"{where}: image pixels are {pixels.dtype}, expected uint8")
    scaled = pixels.astype(np.float32) / 255.0
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    chw = ((scaled - mean) / std).transpose(2, 0, 1)
    return np.ascontiguousarray(chw.reshape(spec.input_shape))


def input_to_image(x: NDArray[Any], spec: DataSpec) -> NDArray[np.uint8]:
    """Inverse of :func:`image_to_input` (rounded to 8-bit pixels)."""
    height, width, channels = spec.image_shape
    chw = np.asarray(x, dtype=np.float32).reshape(channels, height, width)
    hwc = chw.transpose(1, 2, 0) * np.asarray(spec.std) + np.asarray(spec.mean)
    pixels = np.clip(np.round(hwc * 255.0), 0, 255).astype(np.uint8)
    return pixels[:, :, 0] if channels == 1 else pixels


def _check_inputs(x: NDArray[Any], spec: DataSpec, what: str) -> NDArray[np.float32]:
    if x.dtype.kind != "f":
        raise ValueError(
            f"{what} has dtype {x.dtype}; the task's model takes floating-point "
            f"inputs (float32) of shape {spec.input_shape}"
        )
    if tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(
            f"{what} has samples of shape {tuple(x.shape[1:])}; the task's model "
            f"takes {tuple(spec.input_shape)}"
        )
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{what} holds NaN or infinite values")
    return x.astype(np.float32, copy=False)


def _check_labels(y: NDArray[Any], spec: DataSpec, what: str) -> NDArray[np.int64]:
    if y.dtype.kind not in "iu":
        raise ValueError(
            f"{what} has dtype {y.dtype}; labels must be integers "
            f"0..{spec.num_classes - 1}"
        )
    if y.ndim != 1:
        raise ValueError(f"{what} has shape {y.shape}; expected one label per sample")
    if len(y) and (y.min() < 0 or y.max() >= spec.num_classes):
        raise ValueError(
            f"{what} spans {int(y.min())}..{int(y.max())}; the task has "
            f"{spec.num_classes} classes (0..{spec.num_classes - 1})"
        )
    return y.astype(np.int64, copy=False)


def _checked(x: NDArray, y: NDArray, spec: DataSpec, split: str) -> Arrays:
    if len(x) != len(y):
        raise ValueError(f"{split}: {len(x)} inputs but {len(y)} labels")
    return Arrays(
        _check_inputs(x, spec, f"{split} inputs"),
        _check_labels(y, spec, f"{split} labels"),
    )


def _read_npz(path: Path, spec: DataSpec) -> dict[str, Arrays]:
    if path.is_dir():
        path = path / NPZ_NAME
    try:
        with np.load(path, allow_pickle=False) as saved:
            files = {name: saved[name] for name in saved.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        raise ValueError(
            f"not a readable npz file ({type(error).__name__}: {error})"
        ) from None
    missing = {"x", "y"} - set(files)
    if missing:
        raise ValueError(
            f"npz lacks {sorted(missing)} (has {sorted(files)}); expected arrays "
            "x (inputs) and y (labels), optionally x_test and y_test"
        )
    splits = {"train": _checked(files["x"], files["y"], spec, "x/y")}
    if "x_test" in files and "y_test" in files:
        splits["test"] = _checked(
            files["x_test"], files["y_test"], spec, "x_test/y_test"
        )
    return splits


def _read_imagefolder(path: Path, spec: DataSpec) -> dict[str, Arrays]:
    from PIL import Image

    def read(root: Path) -> Arrays:
        xs, ys = [], []
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            try:
                label = int(folder.name)
            except ValueError:
                raise ValueError(
                    f"class folder {folder.name!r} is not an integer label "
                    f"(name class folders 0..{spec.num_classes - 1})"
                ) from None
            if not 0 <= label < spec.num_classes:
                raise ValueError(
                    f"class folder {folder.name!r}: the task has "
                    f"{spec.num_classes} classes (0..{spec.num_classes - 1})"
                )
            for file in sorted(folder.iterdir()):
                if file.suffix.lower() not in IMAGE_SUFFIXES:
                    continue
                try:
                    with Image.open(file) as image:
                        pixels = np.asarray(image)
                except OSError as error:
                    raise ValueError(f"{file}: unreadable image ({error})") from None
                xs.append(image_to_input(pixels, spec, str(file)))
                ys.append(label)
        if not xs:
            raise ValueError(f"{root}: no images in its class folders")
        return Arrays(np.stack(xs), np.asarray(ys, dtype=np.int64))

    split_dirs = {"train": path / "train", "test": path / "test"}
    if split_dirs["train"].is_dir():
        splits = {"train": read(split_dirs["train"])}
        if split_dirs["test"].is_dir():
            splits["test"] = read(split_dirs["test"])
        return splits
    return {"train": read(path)}


def _hf_columns(features: Mapping[str, Any]) -> tuple[str, str]:
    """Return (input column, label column) of a Hugging Face dataset."""
    import datasets

    names = list(features)
    labels = [n for n in names if isinstance(features[n], datasets.ClassLabel)]
    label = "label" if "label" in names else (labels[0] if len(labels) == 1 else None)
    images = [n for n in names if isinstance(features[n], datasets.Image)]
    source = images[0] if len(images) == 1 else ("x" if "x" in names else None)
    if label is None or source is None:
        raise ValueError(
            f"columns {names}: expected a label column ('label' or one ClassLabel) "
            "and one Image column or a column 'x' of model inputs"
        )
    return source, label


def _read_hf_split(table: Any, spec: DataSpec, split: str) -> Arrays:
    import datasets

    source, label = _hf_columns(table.features)
    feature = table.features[label]
    if isinstance(feature, datasets.ClassLabel) and feature.num_classes != (
        spec.num_classes
    ):
        raise ValueError(
            f"{split}: column {label!r} declares {feature.num_classes} classes; "
            f"the task has {spec.num_classes}"
        )
    y = np.asarray(table.with_format("numpy")[label])
    if isinstance(table.features[source], datasets.Image):
        images = table.with_format(None)[source]
        x = np.stack(
            [
                image_to_input(np.asarray(img), spec, f"{split} row {i}")
                for i, img in enumerate(images)
            ]
        ) if len(images) else np.zeros((0, *spec.input_shape), np.float32)  # fmt: skip
    else:
        x = np.asarray(table.with_format("numpy")[source])
    return _checked(x, y, spec, f"{split} column {source!r}/{label!r}")


def _read_hf(path: Path, spec: DataSpec) -> dict[str, Arrays]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001 (pyarrow, json, OS: all "unreadable")
        raise ValueError(
            "not a readable Hugging Face save_to_disk folder "
            f"({type(error).__name__}: {error})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"DatasetDict without a 'train' split ({list(loaded)})")
        splits = {"train": _read_hf_split(loaded["train"], spec, "train")}
        if "test" in loaded:
            splits["test"] = _read_hf_split(loaded["test"], spec, "test")
        return splits
    return {"train": _read_hf_split(loaded, spec, "dataset")}


_READERS = {"hf": _read_hf, "npz": _read_npz, "imagefolder": _read_imagefolder}


def task_spec(task: Task) -> DataSpec:
    """Return the task's :class:`DataSpec` (ValueError for a task without one)."""
    if task.data_spec is None:
        raise ValueError(
            f"task {task.name} does not read node data (data-path): it has no "
            "declared input format"
        )
    return task.data_spec


def read_node_arrays(path: str | Path, task: Task) -> dict[str, Arrays]:
    """Read and check the node data at ``path``: ``{"train": …[, "test": …]}``.

    Raises NodeDataError naming the path and the problem (one line).
    """
    path = Path(path)
    try:
        spec = task_spec(task)
    except ValueError as error:
        raise NodeDataError(path, str(error)) from None
    try:
        splits = _READERS[detect_format(path)](path, spec)
    except NodeDataError:
        raise
    except ValueError as error:
        problem = " ".join(str(error).split())  # one line
        raise NodeDataError(path, f"{problem} (task {task.name})") from None
    except OSError as error:
        raise NodeDataError(path, f"unreadable ({error})") from None
    if len(splits["train"].y) < (1 if "test" in splits else 2):
        raise NodeDataError(path, "too few samples to train on")
    return splits


def _tensors(arrays: Arrays) -> TensorDataset:
    return TensorDataset(torch.from_numpy(arrays.x), torch.from_numpy(arrays.y))


def _read(path: str, task_name: str, test_fraction: float, seed: int) -> ClientData:
    from fedadapt.tasks import TASKS

    splits = read_node_arrays(path, TASKS.get(task_name))
    train = _tensors(splits["train"])
    if "test" in splits:
        return ClientData(train, _tensors(splits["test"]))
    kept, held = train_test_split_indices(
        np.arange(len(train), dtype=np.int64), test_fraction, seed
    )
    return ClientData(Subset(train, kept.tolist()), Subset(train, held.tolist()))


@lru_cache(maxsize=4)
def _load(
    path: str, task_name: str, test_fraction: float, seed: int, ready: bool
) -> ClientData:
    if not ready:
        return _read(path, task_name, test_fraction, seed)
    what = {"data-path": path, "files": tree_signature(path), "task": task_name,
            "client-test-fraction": test_fraction, "seed": seed}  # fmt: skip
    return ready_client_data(
        f"{task_name}-data-path",
        what,
        lambda: _read(path, task_name, test_fraction, seed),
    )


def load_node_data(
    path: str | Path, cfg: Mapping[str, Any], ready: bool = False
) -> ClientData:
    """Return a node's (train, held-out) data from ``path`` for run config ``cfg``.

    Cached per process (keyed by path, task, ``client-test-fraction`` and
    ``seed``): a node reads its files once, not once per message, where its
    ClientApp process lives on (simulation: one Ray actor serves many
    messages). In deployment Flower starts one ClientApp process per
    message: with ``ready`` the first one writes the checked, split arrays
    as ready files (:mod:`fedadapt.tasks.ready_data`, keyed by the files'
    names, sizes and times too) and later ones map them instead of reading
    and checking the files again.
    A failed load is not cached: fixed files are read on the next message.
    """
    return _load(
        str(Path(path).resolve()),
        cfg["task"],
        float(cfg["client-test-fraction"]),
        int(cfg["seed"]),
        ready,
    )


def load_evaluation_set(path: str | Path, task: Task) -> Dataset:
    """Server-side evaluation data: the dataset's ``test`` split, else all of it."""
    splits = read_node_arrays(path, task)
    return _tensors(splits.get("test", splits["train"]))


def load_validation_set(path: str | Path, task: Task) -> TensorDataset:
    """Server-side validation data (the influence screen): its ``train`` split."""
    return _tensors(read_node_arrays(path, task)["train"])


# --- writing (make-node-data) ---------------------------------------------------


def task_pool(task: Task, cfg: Mapping[str, Any]) -> tuple[NDArray, NDArray]:
    """Return the task's training pool as model-ready (x, y) arrays."""
    spec = task_spec(task)
    if spec.pool is None:
        raise ValueError(
            f"task {task.name} offers no local pool to write node datasets from"
        )
    pool = spec.pool(cfg)
    x, y = pool.tensors[0].numpy(), pool.tensors[1].numpy()
    return x.astype(np.float32), y.astype(np.int64)


def _write_npz(folder: Path, data: Arrays, test: Arrays | None) -> None:
    arrays = {"x": data.x, "y": data.y}
    if test is not None:
        arrays |= {"x_test": test.x, "y_test": test.y}
    np.savez(folder / NPZ_NAME, **arrays)  # type: ignore[arg-type]


def _write_imagefolder(folder: Path, data: Arrays, spec: DataSpec) -> None:
    from PIL import Image

    for i, (x, label) in enumerate(zip(data.x, data.y, strict=True)):
        target = folder / str(int(label))
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(input_to_image(x, spec)).save(target / f"{i:06d}.png")


def _hf_dataset(data: Arrays, spec: DataSpec, images: bool) -> Any:
    import datasets

    datasets.disable_progress_bars()  # one per node would flood the terminal
    label = datasets.ClassLabel(num_classes=spec.num_classes)
    if images:
        features = datasets.Features({"image": datasets.Image(), "label": label})
        rows = {"image": [input_to_image(x, spec) for x in data.x]}
    else:
        shape = tuple(spec.input_shape)
        inner: Any = (
            datasets.Sequence(datasets.Value("float32"), length=shape[0])
            if len(shape) == 1
            else datasets.Array3D(shape, "float32")  # type: ignore[arg-type]
            if len(shape) == 3
            else None
        )
        if inner is None:
            raise ValueError(f"input shape {shape}: write images (--hf-images)")
        features = datasets.Features({"x": inner, "label": label})
        rows = {"x": list(data.x)}
    return datasets.Dataset.from_dict(
        {**rows, "label": data.y.tolist()}, features=features
    )


def write_node_datasets(
    task: Task,
    cfg: Mapping[str, Any],
    num_nodes: int,
    out: str | Path,
    formats: Sequence[str],
    hf_images: bool = True,
    force: bool = False,
) -> list[Path]:
    """Split the task's pool with ``cfg["partition"]``; write one dataset per node.

    Node ``i`` gets partition ``i`` in ``formats[i % len(formats)]`` at
    ``<out>/node-<i>`` (``…/data.npz`` for npz): the whole node partition,
    so the node splits off its held-out part itself (see the module doc).
    Everything is written to a temporary folder beside ``out`` and renamed
    into place at the end: ``out`` appears whole or not at all. Returns each
    node's ``data-path``.
    """
    for kind in formats:
        if kind not in FORMATS:
            raise ValueError(f"unknown format {kind!r} (choose from {FORMATS})")
    if num_nodes < 1:
        raise ValueError(f"num-nodes must be at least 1, got {num_nodes}")
    out = Path(out).resolve()
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    spec = task_spec(task)
    x, y = task_pool(task, cfg)
    parts = PARTITIONS.get(cfg["partition"])(y, num_nodes, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    paths, manifest = [], []
    try:
        for i, rows in enumerate(parts):
            kind = formats[i % len(formats)]
            node = tmp / f"node-{i}"
            node.mkdir()
            data = Arrays(x[rows], y[rows])
            if kind == "npz":
                _write_npz(node, data, None)
            elif kind == "imagefolder":
                _write_imagefolder(node, data, spec)
            else:
                _hf_dataset(data, spec, hf_images).save_to_disk(str(node))
            rel = f"node-{i}/data.npz" if kind == "npz" else f"node-{i}"
            paths.append(out / rel)
            counts = np.bincount(data.y, minlength=spec.num_classes)
            manifest.append(
                {
                    "node": i,
                    "format": kind,
                    "data-path": rel,
                    "samples": len(rows),
                    "class-counts": counts.tolist(),
                }
            )
        summary = {"task": task.name, "partition": cfg["partition"], "nodes": manifest}
        (tmp / "nodes.json").write_text(json.dumps(summary, indent=2))
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return paths
