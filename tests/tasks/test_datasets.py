"""Dataset loaders on tiny files written in the real on-disk formats."""

from __future__ import annotations

import importlib.util
import json
import pickle
import socket
import struct
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from fedadapt.tasks import datasets as D

N_TRAIN, N_TEST = 20, 10


# ---------------------------------------------------------------------------
# Writers for the real formats
# ---------------------------------------------------------------------------


def write_idx_images(path: Path, images: np.ndarray) -> None:
    """IDX3: magic 2051 (0x00000803), then n, rows, cols, all big-endian."""
    n, rows, cols = images.shape
    path.write_bytes(struct.pack(">4i", 2051, n, rows, cols) + images.tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    """IDX1: magic 2049 (0x00000801), then n, big-endian."""
    path.write_bytes(struct.pack(">2i", 2049, len(labels)) + labels.tobytes())


def make_mnist(root: Path, folder: str = "MNIST", seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    out = {}
    for prefix, n in (("train", N_TRAIN), ("t10k", N_TEST)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx_images(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx_labels(raw / f"{prefix}-labels-idx1-ubyte", labels)
        out[prefix] = (images, labels)
    return out


def _pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=2)


def make_cifar10(root: Path, per_batch: int = 4, seed: int = 0) -> dict:
    """cifar-10-batches-py: 5 train batches, test_batch, batches.meta."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    out = {"train": [], "test": []}
    for fname in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        _pickle(
            folder / fname,
            {
                "batch_label": fname,
                "labels": labels,
                "data": data,
                "filenames": [f"{fname}_{i}.png" for i in range(per_batch)],
            },
        )
        out["test" if fname == "test_batch" else "train"].append((data, labels))
    names = ["airplane", "automobile", "bird", "cat", "deer"]
    names += ["dog", "frog", "horse", "ship", "truck"]
    _pickle(
        folder / "batches.meta",
        {"label_names": names, "num_cases_per_batch": per_batch, "num_vis": 3072},
    )
    return out


def make_cifar100(root: Path, seed: int = 0) -> dict:
    """cifar-100-python: train, test, meta with fine and coarse labels."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    out = {}
    for fname, n in (("train", N_TRAIN), ("test", N_TEST)):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        fine = rng.integers(0, 100, size=n).tolist()
        _pickle(
            folder / fname,
            {
                "filenames": [f"{i}.png" for i in range(n)],
                "batch_label": fname,
                "fine_labels": fine,
                "coarse_labels": [f // 5 for f in fine],
                "data": data,
            },
        )
        out[fname] = (data, fine)
    _pickle(
        folder / "meta",
        {
            "fine_label_names": [f"fine{i}" for i in range(100)],
            "coarse_label_names": [f"coarse{i}" for i in range(20)],
        },
    )
    return out


FEMNIST_USERS = {  # file → user → number of samples
    "all_data_1_niid_0_keep_0_train_9.json": {"f0003_10": 3, "f0001_41": 2},
    "all_data_0_niid_0_keep_0_train_9.json": {"f0002_07": 4},
}


def _leaf_blob(user_data: dict) -> dict:
    return {
        "users": list(user_data),
        "num_samples": [len(d["y"]) for d in user_data.values()],
        "user_data": user_data,
    }


def make_femnist(root: Path, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    everything: dict = {"train": {}, "test": {}}
    train_dir = root / "femnist" / "data" / "train"
    test_dir = root / "femnist" / "data" / "test"
    train_dir.mkdir(parents=True)
    test_dir.mkdir(parents=True)
    for fname, users in FEMNIST_USERS.items():
        chunk = {}
        for user, n in users.items():
            x = rng.random((n, 784)).round(4).tolist()
            y = rng.integers(0, 62, size=n).tolist()
            chunk[user] = {"x": x, "y": y}
        everything["train"].update(chunk)
        (train_dir / fname).write_text(json.dumps(_leaf_blob(chunk)))
    test_chunk = {
        u: {"x": rng.random((1, 784)).tolist(), "y": [61]}
        for u in ("f0003_10", "f0002_07")  # f0001_41 has no test data
    }
    everything["test"] = test_chunk
    (test_dir / "all_data_niid_0_keep_0_test_9.json").write_text(
        json.dumps(_leaf_blob(test_chunk))
    )
    return everything


SPEECH = (
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind "
    "to suffer The slings and arrows of outrageous fortune, Or to take arms!"
)


def _windows(text: str, count: int, start: int = 0) -> dict:
    xs = [text[start + i : start + i + 80] for i in range(count)]
    ys = [text[start + i + 80] for i in range(count)]
    return {"x": xs, "y": ys}


def make_shakespeare(root: Path) -> dict:
    train = {
        "THE_TRAGEDY_OF_HAMLET_HAMLET": _windows(SPEECH, 3),
        "AS_YOU_LIKE_IT_ROSALIND": _windows(SPEECH, 2, start=10),
    }
    test = {"THE_TRAGEDY_OF_HAMLET_HAMLET": _windows(SPEECH, 1, start=40)}
    for split, data in (("train", train), ("test", test)):
        folder = root / "shakespeare" / "data" / split
        folder.mkdir(parents=True)
        (folder / f"all_data_niid_0_keep_0_{split}_9.json").write_text(
            json.dumps(_leaf_blob(data))
        )
    return {"train": train, "test": test}


# ---------------------------------------------------------------------------
# torchvision datasets
# ---------------------------------------------------------------------------


def _mnist_pixels(images: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(images).float() / 255 - 0.1307) / 0.3081


@pytest.mark.parametrize(
    ("name", "folder"), [("mnist", "MNIST"), ("fmnist", "FashionMNIST")]
)
def test_mnist_family_real_idx_files(tmp_path, name, folder):
    written = make_mnist(tmp_path, folder)
    for train, prefix, n in ((True, "train", N_TRAIN), (False, "t10k", N_TEST)):
        ds = D.load_torchvision(name, tmp_path, train=train)
        images, labels = written[prefix]
        assert len(ds) == n
        np.testing.assert_array_equal(D.labels_of(ds), labels.astype(np.int64))
        x, y = ds[3]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32
        assert y == int(labels[3])
        torch.testing.assert_close(x[0], _mnist_pixels(images[3]))


def test_mnist_normalisation_maps_black_and_white(tmp_path):
    make_mnist(tmp_path)
    raw = tmp_path / "MNIST" / "raw"
    images = np.zeros((N_TRAIN, 28, 28), dtype=np.uint8)
    images[:, :14] = 255
    write_idx_images(raw / "train-images-idx3-ubyte", images)
    x, _ = D.load_torchvision("mnist", str(tmp_path), train=True)[0]
    assert x[0, 0, 0].item() == pytest.approx((1 - 0.1307) / 0.3081, rel=1e-5)
    assert x[0, -1, 0].item() == pytest.approx(-0.1307 / 0.3081, rel=1e-5)


def _cifar_image(row: np.ndarray, mean, std) -> torch.Tensor:
    chw = torch.from_numpy(row.reshape(3, 32, 32)).float() / 255
    return (chw - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def test_cifar10_real_batches(tmp_path):
    written = make_cifar10(tmp_path)
    train = D.load_torchvision("cifar10", tmp_path, train=True)
    test = D.load_torchvision("cifar10", tmp_path, train=False)
    assert len(train) == 20 and len(test) == 4
    train_labels = sum((labels for _, labels in written["train"]), [])
    np.testing.assert_array_equal(D.labels_of(train), train_labels)
    np.testing.assert_array_equal(D.labels_of(test), written["test"][0][1])
    assert train.classes[0] == "airplane"
    # sample 4 is the first of data_batch_2 (4 per batch)
    x, y = train[4]
    assert x.shape == (3, 32, 32) and y == written["train"][1][1][0]
    expected = _cifar_image(written["train"][1][0][0], D.CIFAR10_MEAN, D.CIFAR10_STD)
    torch.testing.assert_close(x, expected)


def test_cifar100_real_files_use_fine_labels(tmp_path):
    written = make_cifar100(tmp_path)
    train = D.load_torchvision("cifar100", tmp_path, train=True)
    test = D.load_torchvision("cifar100", tmp_path, train=False)
    assert (len(train), len(test)) == (N_TRAIN, N_TEST)
    np.testing.assert_array_equal(D.labels_of(train), written["train"][1])
    x, y = test[2]
    assert y == written["test"][1][2]
    expected = _cifar_image(written["test"][0][2], D.CIFAR100_MEAN, D.CIFAR100_STD)
    torch.testing.assert_close(x, expected)


def test_cifar_augmentation_only_on_train(tmp_path):
    from torchvision import transforms as T

    make_cifar10(tmp_path)
    aug = D.load_torchvision("cifar10", tmp_path, train=True, augment=True)
    kinds = [type(t) for t in aug.transform.transforms]
    assert kinds[:2] == [T.RandomCrop, T.RandomHorizontalFlip]
    assert aug.transform.transforms[0].padding == 4
    assert aug[0][0].shape == (3, 32, 32)
    plain = D.load_torchvision("cifar10", tmp_path, train=False)
    test_aug = D.load_torchvision("cifar10", tmp_path, train=False, augment=True)
    torch.testing.assert_close(test_aug[1][0], plain[1][0])


def test_stock_torchvision_rejects_unofficial_files_ours_accepts(tmp_path):
    """Why the CIFAR classes are subclassed: torchvision checks MD5 on load."""
    from torchvision.datasets import CIFAR10

    make_cifar10(tmp_path)
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR10(root=str(tmp_path), train=True, download=False)
    assert len(D.load_torchvision("cifar10", tmp_path)) == 20
    with pytest.raises(D.DatasetCorruptError, match="data_batch_1"):
        D.load_torchvision("cifar10", tmp_path, verify_checksums=True)


def test_labels_of_wrappers():
    base = TensorDataset(torch.zeros(5, 2), torch.tensor([4, 3, 2, 1, 0]))
    np.testing.assert_array_equal(D.labels_of(Subset(base, [4, 0])), [0, 4])
    both = ConcatDataset([base, Subset(base, [1])])
    np.testing.assert_array_equal(D.labels_of(both), [4, 3, 2, 1, 0, 3])
    assert D.labels_of(base).dtype == np.int64

    class Opaque(Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return 0, 0

    with pytest.raises(TypeError, match="targets"):
        D.labels_of(Opaque())


def test_unknown_name():
    with pytest.raises(ValueError, match="Unknown dataset"):
        D.load_torchvision("svhn", "/nonexistent")


# ---------------------------------------------------------------------------
# Missing data
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("mnist", "MNIST/raw/train-images-idx3-ubyte"),
        ("fmnist", "FashionMNIST/raw/t10k-labels-idx1-ubyte"),
        ("cifar10", "cifar-10-batches-py/data_batch_1"),
        ("cifar100", "cifar-100-python/train"),
    ],
)
def test_missing_torchvision_data_names_layout(tmp_path, name, needle):
    with pytest.raises(D.DatasetMissingError) as info:
        D.load_torchvision(name, tmp_path / "data")
    msg = str(info.value)
    assert str(tmp_path / "data" / needle) in msg
    assert "download=True" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_missing_single_cifar_batch_is_named(tmp_path):
    make_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(D.DatasetMissingError) as info:
        D.load_torchvision("cifar10", tmp_path, train=False)
    missing_part = str(info.value).split("Expected layout")[0]
    assert "data_batch_3" in missing_part and "data_batch_2" not in missing_part


@pytest.mark.parametrize("name", ["femnist", "shakespeare"])
def test_missing_leaf_data_names_layout(tmp_path, name):
    with pytest.raises(D.DatasetMissingError) as info:
        D.load_leaf(tmp_path, name, "train")
    msg = str(info.value)
    assert str(tmp_path / name / "data" / "train") in msg
    assert "LEAF" in msg


# ---------------------------------------------------------------------------
# LEAF
# ---------------------------------------------------------------------------


def test_femnist_users_and_clients(tmp_path):
    written = make_femnist(tmp_path)
    users = D.leaf_users(tmp_path, "femnist")
    assert users == ["f0001_41", "f0002_07", "f0003_10"]  # sorted, across files
    data = D.load_leaf(tmp_path, "femnist", "train")
    assert list(data) == users
    for user in users:
        x, y = data[user]
        ref = written["train"][user]
        assert x.shape == (len(ref["y"]), 1, 28, 28) and x.dtype == torch.float32
        assert y.dtype == torch.int64 and y.tolist() == ref["y"]
        torch.testing.assert_close(
            x.reshape(len(ref["y"]), -1), torch.tensor(ref["x"], dtype=torch.float32)
        )
    train, test = D.leaf_client_data(tmp_path, "femnist", 2)  # f0003_10
    assert len(train) == 3 and len(test) == 1
    assert test[0][1].item() == 61
    train, test = D.leaf_client_data(tmp_path, "femnist", 0)  # no test entry
    assert len(train) == 2 and len(test) == 0
    assert test.tensors[0].shape[1:] == (1, 28, 28)
    assert len(D.leaf_test_dataset(tmp_path, "femnist")) == 2
    np.testing.assert_array_equal(D.labels_of(train), written["train"]["f0001_41"]["y"])
    with pytest.raises(IndexError):
        D.leaf_client_data(tmp_path, "femnist", 3)


def test_leaf_reload_after_file_change(tmp_path):
    make_femnist(tmp_path)
    assert len(D.leaf_users(tmp_path, "femnist")) == 3
    extra = {"f0009_99": {"x": [[0.5] * 784], "y": [7]}}
    path = tmp_path / "femnist" / "data" / "train" / "zz_extra.json"
    path.write_text(json.dumps(_leaf_blob(extra)))
    assert D.leaf_users(tmp_path, "femnist")[-1] == "f0009_99"


def test_leaf_duplicate_user_rejected(tmp_path):
    make_femnist(tmp_path)
    dup = {"f0002_07": {"x": [[0.0] * 784], "y": [1]}}
    path = tmp_path / "femnist" / "data" / "train" / "dup.json"
    path.write_text(json.dumps(_leaf_blob(dup)))
    with pytest.raises(ValueError, match="twice"):
        D.load_leaf(tmp_path, "femnist", "train")


def test_shakespeare_vocabulary():
    assert D.SHAKESPEARE_VOCAB_SIZE == 80 == len(set(D.SHAKESPEARE_VOCAB))
    assert D.SHAKESPEARE_VOCAB[0] == "\n" and D.SHAKESPEARE_VOCAB[-1] == "}"
    assert D.shakespeare_encode("\n a}") == [0, 1, 53, 79]
    assert D.shakespeare_decode(D.shakespeare_encode(SPEECH)) == SPEECH
    with pytest.raises(ValueError, match="'@'"):
        D.shakespeare_encode("a@b")


def test_shakespeare_clients(tmp_path):
    written = make_shakespeare(tmp_path)
    assert D.leaf_users(tmp_path, "shakespeare") == [
        "AS_YOU_LIKE_IT_ROSALIND",
        "THE_TRAGEDY_OF_HAMLET_HAMLET",
    ]
    train, test = D.leaf_client_data(tmp_path, "shakespeare", 1)
    x, y = train.tensors
    assert x.shape == (3, 80) and x.dtype == torch.int64
    assert y.shape == (3,) and y.dtype == torch.int64
    ref = written["train"]["THE_TRAGEDY_OF_HAMLET_HAMLET"]
    for i in range(3):
        assert D.shakespeare_decode(x[i]) == ref["x"][i]
        assert y[i].item() == D.SHAKESPEARE_VOCAB.index(ref["y"][i])
        # the label is the character that follows the window
        assert SPEECH[i + 80] == D.SHAKESPEARE_VOCAB[y[i]]
    assert x[0, 0].item() == D.SHAKESPEARE_VOCAB.index("T")
    assert len(test) == 1 and test.tensors[0].shape == (1, 80)
    _, empty = D.leaf_client_data(tmp_path, "shakespeare", 0)
    assert len(empty) == 0 and empty.tensors[0].shape == (0, 80)


# ---------------------------------------------------------------------------
# No network, optional Flower Datasets
# ---------------------------------------------------------------------------


def test_no_network_is_touched(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    make_mnist(tmp_path)
    make_mnist(tmp_path, "FashionMNIST")
    make_cifar10(tmp_path)
    make_cifar100(tmp_path)
    make_femnist(tmp_path)
    make_shakespeare(tmp_path)
    for name in D.TORCHVISION_DATASETS:
        for train in (True, False):
            ds = D.load_torchvision(name, tmp_path, train=train, augment=True)
            assert ds[0][0].ndim == 3
    for name in D.LEAF_DATASETS:
        assert len(D.leaf_client_data(tmp_path, name, 0)[0]) > 0
    # missing data fails with the helpful error instead of trying to download
    with pytest.raises(D.DatasetMissingError):
        D.load_torchvision("mnist", tmp_path / "empty")


@pytest.mark.skipif(
    importlib.util.find_spec("flwr_datasets") is not None,
    reason="flwr_datasets is installed; its online path is not tested",
)
def test_flwr_datasets_absent_gives_install_hint():
    with pytest.raises(ImportError, match="pip install flwr-datasets"):
        D.flwr_federated_dataset("cifar10", num_partitions=10)
