"""A node's own data on disk (node-config ``data-path``): read, checked, written.

Every fixture is written in its real format by that format's own library
(``datasets``' ``save_to_disk``, PNGs via PIL, ``np.savez``), and what the
loader returns is compared with values computed here from the raw pixels
or arrays (pixels / 255, normalised with the spec's mean and std).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from fedadapt.tasks import TASKS, DataSpec, Task
from fedadapt.tasks.node_data import (
    NodeDataError,
    load_evaluation_set,
    load_node_data,
    read_node_arrays,
    write_node_datasets,
)
from fedadapt.tasks.partition import PARTITIONS

DIGITS = TASKS.get("digits-mlp")  # inputs (64,) float32, 10 classes, 8×8×1 images


def _rgb_task(num_classes: int = 3) -> Task:
    """A 2×2 RGB task with per-channel normalisation (the CIFAR-like path)."""
    mean, std = (0.5, 0.25, 0.0), (0.5, 2.0, 1.0)
    spec = DataSpec((3, 2, 2), num_classes, (2, 2, 3), mean, std)
    return Task("rgb-test", "test", lambda: None, None, None, data_spec=spec)


def _digits_arrays(n: int = 20, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n)


def _pixels(n: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 8, 8), dtype=np.uint8), np.arange(n) % 10


def _save_pngs(root, pixels, labels) -> None:
    for i, (image, label) in enumerate(zip(pixels, labels, strict=True)):
        folder = root / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i}.png")


def _cfg(cfg, **kw):
    return cfg(task="digits-mlp", **kw)


# --- the three formats, read back -------------------------------------------------


def test_npz_inputs_come_back_as_saved(tmp_path, cfg):
    x, y = _digits_arrays()
    np.savez(tmp_path / "d.npz", x=x.astype(np.float64), y=y.astype(np.int32))
    splits = read_node_arrays(tmp_path / "d.npz", DIGITS)
    assert list(splits) == ["train"]
    np.testing.assert_array_equal(splits["train"].x, x)
    assert splits["train"].x.dtype == np.float32
    np.testing.assert_array_equal(splits["train"].y, y)
    assert splits["train"].y.dtype == np.int64


def test_an_npz_node_folder_reads_its_data_npz(tmp_path):
    """Containers mount every node's folder at one path (data-path='/data'):
    the folder make-node-data writes for an npz node (<node>/data.npz) reads
    as that file."""
    x, y = _digits_arrays()
    np.savez(tmp_path / "data.npz", x=x, y=y)
    got = read_node_arrays(tmp_path, DIGITS)["train"]
    np.testing.assert_array_equal(got.x, x)
    np.testing.assert_array_equal(got.y, y)


def test_image_folder_pixels_are_scaled_as_the_task_does(tmp_path):
    pixels, labels = _pixels()
    _save_pngs(tmp_path, pixels, labels)
    got = read_node_arrays(tmp_path, DIGITS)["train"]
    order = sorted(range(len(labels)), key=lambda i: (labels[i], f"{i}.png"))
    np.testing.assert_allclose(
        got.x, pixels[order].reshape(-1, 64) / np.float32(255), rtol=1e-6
    )
    np.testing.assert_array_equal(got.y, labels[order])


def test_image_folder_labels_are_folder_names_not_their_order(tmp_path):
    # a node holding only classes 3 and 7 must not see them as 0 and 1
    pixels, _ = _pixels(4)
    _save_pngs(tmp_path, pixels, [3, 3, 7, 7])
    assert read_node_arrays(tmp_path, DIGITS)["train"].y.tolist() == [3, 3, 7, 7]


def test_rgb_images_are_normalised_per_channel_channels_first(tmp_path):
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (4, 2, 2, 3), dtype=np.uint8)
    _save_pngs(tmp_path, pixels, [0, 1, 2, 0])
    got = read_node_arrays(tmp_path, _rgb_task())["train"]
    mean, std = np.array([0.5, 0.25, 0.0]), np.array([0.5, 2.0, 1.0])
    expected = ((pixels / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    order = [0, 3, 1, 2]  # folders 0, 1, 2; inside 0: 0.png, 3.png
    np.testing.assert_allclose(got.x, expected[order], rtol=1e-5)


def test_hf_image_dataset_as_flwr_datasets_writes_it(tmp_path):
    import datasets

    pixels, labels = _pixels()
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)}
    )
    datasets.Dataset.from_dict(
        {"image": [Image.fromarray(p) for p in pixels], "label": labels.tolist()},
        features=features,
    ).save_to_disk(str(tmp_path / "p0"))
    got = read_node_arrays(tmp_path / "p0", DIGITS)["train"]
    np.testing.assert_allclose(got.x, pixels.reshape(-1, 64) / np.float32(255))
    np.testing.assert_array_equal(got.y, labels)


def test_hf_array_column_and_its_test_split(tmp_path):
    import datasets

    x, y = _digits_arrays(10)
    xt, yt = _digits_arrays(4, seed=1)
    table = datasets.Dataset.from_dict
    datasets.DatasetDict(
        {
            "train": table({"x": x.tolist(), "label": y.tolist()}),
            "test": table({"x": xt.tolist(), "label": yt.tolist()}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    splits = read_node_arrays(tmp_path / "dd", DIGITS)
    np.testing.assert_allclose(splits["train"].x, x)
    np.testing.assert_array_equal(splits["test"].y, yt)


# --- held-out split ---------------------------------------------------------------


def test_without_a_test_split_the_node_holds_out_a_seeded_fraction(tmp_path, cfg):
    x, y = _digits_arrays(20)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    data = load_node_data(tmp_path / "d.npz", _cfg(cfg, seed=3))
    train = [int(i) for i in data.train.indices]
    test = [int(i) for i in data.test.indices]
    # oracle: round(0.2 · 20) = 4 held out, disjoint, together all 20
    assert len(test) == 4 and sorted(train + test) == list(range(20))
    shuffled = np.random.default_rng(3).permutation(20)
    assert sorted(test) == sorted(shuffled[:4].tolist())


def test_a_saved_test_split_is_the_held_out_split(tmp_path, cfg):
    x, y = _digits_arrays(8)
    xt, yt = _digits_arrays(3, seed=1)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=xt, y_test=yt)
    data = load_node_data(tmp_path / "d.npz", _cfg(cfg))
    assert len(data.train) == 8 and len(data.test) == 3
    np.testing.assert_array_equal(data.test.tensors[1].numpy(), yt)


def test_image_folder_with_train_and_test_folders(tmp_path):
    pixels, labels = _pixels(6)
    _save_pngs(tmp_path / "train", pixels[:4], labels[:4])
    _save_pngs(tmp_path / "test", pixels[4:], labels[4:])
    splits = read_node_arrays(tmp_path, DIGITS)
    assert len(splits["train"].y) == 4 and splits["test"].y.tolist() == [4, 5]


def test_loaded_once_per_process_and_a_failure_is_not_cached(tmp_path, cfg):
    path = tmp_path / "d.npz"
    path.write_bytes(b"not an npz")
    with pytest.raises(NodeDataError):
        load_node_data(path, _cfg(cfg))
    x, y = _digits_arrays()
    np.savez(path, x=x, y=y)  # fixed: the next message reads it
    first = load_node_data(path, _cfg(cfg))
    assert load_node_data(path, _cfg(cfg)) is first


# --- bad input: one line naming the path and the problem ------------------------


def _error(path, task=DIGITS) -> str:
    with pytest.raises(NodeDataError) as caught:
        read_node_arrays(path, task)
    message = str(caught.value)
    assert "\n" not in message and f"data-path {path}" in message
    return message


def test_missing_path(tmp_path):
    assert "no such file or folder" in _error(tmp_path / "absent")


def test_corrupt_npz(tmp_path):
    (tmp_path / "d.npz").write_bytes(b"PK\x03\x04 truncated zip")
    assert "not a readable npz file" in _error(tmp_path / "d.npz")


def test_corrupt_hf_arrow_file(tmp_path):
    import datasets

    x, y = _digits_arrays()
    datasets.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()}).save_to_disk(
        str(tmp_path / "hf")
    )
    arrow = next((tmp_path / "hf").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])
    assert "not a readable Hugging Face save_to_disk folder" in _error(tmp_path / "hf")


def test_corrupt_png(tmp_path):
    pixels, labels = _pixels(2)
    _save_pngs(tmp_path, pixels, labels)
    (tmp_path / "0" / "0.png").write_bytes(b"\x89PNG garbage")
    assert "0.png: unreadable image" in _error(tmp_path)


def test_wrong_shape(tmp_path):
    x, y = _digits_arrays()
    np.savez(tmp_path / "d.npz", x=x[:, :63], y=y)
    assert "samples of shape (63,); the task's model takes (64,)" in _error(
        tmp_path / "d.npz"
    )


def test_wrong_image_size(tmp_path):
    _save_pngs(tmp_path, np.zeros((1, 28, 28), np.uint8), [0])
    assert "image is 28×28×1 (H×W×C), the task expects 8×8×1" in _error(tmp_path)


def test_wrong_class_count_npz(tmp_path):
    x, _ = _digits_arrays(3)
    np.savez(tmp_path / "d.npz", x=x, y=np.array([0, 5, 11]))
    assert "spans 0..11; the task has 10 classes" in _error(tmp_path / "d.npz")


def test_wrong_class_count_hf_class_label(tmp_path):
    import datasets

    x, y = _digits_arrays()
    features = datasets.Features(
        {
            "x": datasets.Sequence(datasets.Value("float32")),
            "label": datasets.ClassLabel(num_classes=12),
        }
    )
    datasets.Dataset.from_dict(
        {"x": x.tolist(), "label": y.tolist()}, features=features
    ).save_to_disk(str(tmp_path / "hf"))
    assert "declares 12 classes; the task has 10" in _error(tmp_path / "hf")


def test_wrong_class_folder(tmp_path):
    _save_pngs(tmp_path, np.zeros((1, 8, 8), np.uint8), [10])
    assert "class folder '10': the task has 10 classes" in _error(tmp_path)


def test_wrong_input_dtype(tmp_path):
    x, y = _digits_arrays()
    np.savez(tmp_path / "d.npz", x=(x * 16).astype(np.int64), y=y)
    assert "dtype int64; the task's model takes floating-point" in _error(
        tmp_path / "d.npz"
    )


def test_wrong_label_dtype(tmp_path):
    x, y = _digits_arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y.astype(np.float32))
    assert "labels has dtype float32; labels must be integers" in _error(
        tmp_path / "d.npz"
    )


def test_a_task_without_a_data_spec_is_refused(tmp_path):
    x, y = _digits_arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    assert "does not read node data" in _error(
        tmp_path / "d.npz", TASKS.get("synthetic-linreg")
    )


def test_the_client_names_its_node(tmp_path, cfg):
    from fedadapt.client.local import client_data

    with pytest.raises(NodeDataError, match=r"^node 42 data-path .*absent: no such"):
        client_data(_cfg(cfg), 0, 1, str(tmp_path / "absent"), node_id=42)


# --- make-node-data -----------------------------------------------------------------


def test_written_nodes_hold_the_partition_in_every_format(tmp_path, cfg):
    run = _cfg(cfg, partition="dirichlet", dirichlet_alpha=0.5)
    paths = write_node_datasets(
        DIGITS, run, 3, tmp_path / "out", ["hf", "npz", "imagefolder"]
    )
    pool = DIGITS.data_spec.pool(run)
    x, y = pool.tensors[0].numpy(), pool.tensors[1].numpy()
    parts = PARTITIONS.get("dirichlet")(y, 3, run)
    for path, rows in zip(paths, parts, strict=True):
        got = read_node_arrays(path, DIGITS)["train"]
        # images are 8-bit: the digits' k/16 come back within half a grey level
        order = np.lexsort((np.arange(len(rows)), y[rows]))
        if path.is_dir() and not (path / "state.json").exists():  # image folder
            expected_x, expected_y = x[rows][order], y[rows][order]
        else:
            expected_x, expected_y = x[rows], y[rows]
        np.testing.assert_array_equal(got.y, expected_y)
        np.testing.assert_allclose(got.x, expected_x, atol=0.5 / 255 + 1e-7)
    manifest = json.loads((tmp_path / "out" / "nodes.json").read_text())
    assert [n["samples"] for n in manifest["nodes"]] == [len(p) for p in parts]
    assert [n["format"] for n in manifest["nodes"]] == ["hf", "npz", "imagefolder"]


def test_a_failed_write_leaves_nothing(tmp_path, cfg, monkeypatch):
    from fedadapt.tasks import node_data

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(node_data, "_write_imagefolder", fail)
    with pytest.raises(OSError, match="disk full"):
        write_node_datasets(
            DIGITS, _cfg(cfg), 2, tmp_path / "out", ["npz", "imagefolder"]
        )
    assert os.listdir(tmp_path) == []


def test_make_node_data_command(tmp_path, capsys):
    from fedadapt.tools.cli import main

    out = tmp_path / "nodes"
    args = ["make-node-data", "--num-nodes", "2", "--partitioner", "iid",
            "--format", "npz", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    # #42: the printed option is what flower-supernode takes: one shell word
    # whose value Flower's own parser (TOML) reads back as the path
    import shlex

    from flwr.common.config import parse_config_args

    hint = printed.splitlines()[1].split("(", 1)[1].rsplit(")", 1)[0]
    flag, value = shlex.split(hint)
    assert flag == "--node-config"
    assert parse_config_args([value]) == {"data-path": f"{out}/node-1/data.npz"}
    assert main(args) == 2  # exists: refused without --force
    assert "--force" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0


def test_evaluation_set_is_the_test_split_else_everything(tmp_path):
    x, y = _digits_arrays(8)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    np.savez(tmp_path / "b.npz", x=x, y=y, x_test=x[:2], y_test=y[:2])
    assert len(load_evaluation_set(tmp_path / "a.npz", DIGITS)) == 8
    assert len(load_evaluation_set(tmp_path / "b.npz", DIGITS)) == 2


@pytest.mark.parametrize(
    "name", [n for n in TASKS.names() if TASKS.get(n).data_spec is not None]
)
def test_every_declared_spec_fits_its_model(name):
    """An input of the spec's shape gives one score per declared class."""
    import torch

    task = TASKS.get(name)
    spec = task.data_spec
    model = task.build_model().eval()
    with torch.no_grad():
        out = model(torch.zeros((2, *spec.input_shape)))
    assert tuple(out.shape) == (2, spec.num_classes)


def test_unreadable_folder(tmp_path, monkeypatch):
    from pathlib import Path

    (tmp_path / "d").mkdir()

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)  # as for a folder of mode 0
    assert "unreadable ([Errno 13] Permission denied" in _error(tmp_path / "d")
