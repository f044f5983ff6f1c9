"""#40: a node's data as ready files, written once and memory-mapped after.

The oracle is the data computed the old way (the task's ``load_client``, the
node-data reader without ready files): the files must give exactly its
values in its order, a change of anything defining the data must give other
files, and damaged files must be recomputed and rewritten.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from fedadapt.client import local
from fedadapt.client.local import client_data, train_round
from fedadapt.config import validate_run_config
from fedadapt.tasks import TASKS, ClientData
from fedadapt.tasks import node_data as node_data_module
from fedadapt.tasks.node_data import load_node_data
from fedadapt.tasks.ready_data import (
    ARRAYS,
    KEEP_DAYS,
    META,
    dataset_arrays,
    read_ready,
    ready_client_data,
    ready_dir,
    tree_signature,
)

pytestmark = pytest.mark.app


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A cache folder per test, and no data kept from another test's process."""
    monkeypatch.setenv("FEDADAPT_CACHE_DIR", str(tmp_path / "cache"))
    local._client_data.cache_clear()
    node_data_module._load.cache_clear()
    yield
    local._client_data.cache_clear()
    node_data_module._load.cache_clear()


def _values(dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
    got = dataset_arrays(dataset)
    assert got is not None
    return got


def assert_same_data(got: ClientData, want: ClientData) -> None:
    for split in ("train", "test"):
        (gx, gy), (wx, wy) = _values(getattr(got, split)), _values(getattr(want, split))
        assert gx.dtype == wx.dtype and gy.dtype == wy.dtype
        np.testing.assert_array_equal(gx, wx, strict=True)
        np.testing.assert_array_equal(gy, wy, strict=True)


def _cfg(**overrides) -> dict:
    return validate_run_config({"task": "digits-mlp", "partition": "iid", **overrides})


def _folders() -> list[Path]:
    return sorted(ready_dir().iterdir()) if ready_dir().exists() else []


def _counting(data: ClientData) -> tuple[list[int], object]:
    calls: list[int] = []

    def compute() -> ClientData:
        calls.append(1)
        return data

    return calls, compute


def test_the_ready_partition_is_the_recomputed_one_exactly():
    cfg = _cfg()
    oracle = TASKS.get("digits-mlp").load_client(cfg, 1, 3)
    first = client_data(cfg, 1, 3)  # computes and writes
    assert len(_folders()) == 1
    local._client_data.cache_clear()  # a new process: read from the files
    again = client_data(cfg, 1, 3)
    assert isinstance(again.train, TensorDataset)  # the mapped arrays
    assert_same_data(first, oracle)
    assert_same_data(again, oracle)


def test_a_round_on_the_ready_files_is_bit_identical(monkeypatch):
    cfg = _cfg(**{"local-steps": 5, "local-epochs": 0, "batch-size": 16})
    torch.manual_seed(0)
    state = TASKS.get("digits-mlp").build_model().state_dict()

    def round_state() -> dict[str, torch.Tensor]:
        local._client_data.cache_clear()
        return train_round(cfg, 2, 3, state, lr=0.1, server_round=3).state

    monkeypatch.setattr(local, "one_message_process", lambda: False)
    want = round_state()  # the old path: no ready files
    assert _folders() == []
    monkeypatch.setattr(local, "one_message_process", lambda: True)
    round_state()  # writes
    got = round_state()  # reads
    assert len(_folders()) == 1
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_files_are_read_not_recomputed():
    data = TASKS.get("digits-mlp").load_client(_cfg(), 0, 2)
    calls, compute = _counting(data)
    ready_client_data("x", {"k": 1}, compute)
    got = ready_client_data("x", {"k": 1}, compute)
    assert calls == [1]
    assert_same_data(got, data)
    train_x = got.train.tensors[0]  # type: ignore[attr-defined]
    assert isinstance(train_x, torch.Tensor) and len(train_x) == len(data.train)


def test_a_changed_key_recomputes(tmp_path):
    data = TASKS.get("digits-mlp").load_client(_cfg(), 0, 2)
    calls, compute = _counting(data)
    ready_client_data("x", {"seed": 1}, compute)
    ready_client_data("x", {"seed": 2}, compute)
    assert calls == [1, 1] and len(_folders()) == 2
    # run config, partition and the data folder's files all key the files
    cfg = _cfg(**{"data-dir": str(tmp_path / "data")})
    client_data(cfg, 0, 3)
    client_data({**cfg, "seed": 7}, 0, 3)
    client_data(cfg, 1, 3)
    client_data(cfg, 0, 4)
    assert len(_folders()) == 6
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "new.bin").write_bytes(b"1")
    local._client_data.cache_clear()
    client_data(cfg, 0, 3)
    assert len(_folders()) == 7


def test_tree_signature_sees_names_sizes_and_times(tmp_path):
    assert tree_signature(tmp_path / "absent") == []
    (tmp_path / "a").mkdir()
    file = tmp_path / "a" / "f.bin"
    file.write_bytes(b"12")
    before = tree_signature(tmp_path)
    assert [(name, size) for name, size, _ in before] == [("a/f.bin", 2)]
    os.utime(file, ns=(1, 1))
    assert tree_signature(tmp_path) != before
    assert tree_signature(file) == [("", 2, 1)]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "no-meta", "bad-meta",
                                    "wrong-shape", "missing-array"])  # fmt: skip
def test_a_damaged_folder_is_ignored_and_rewritten(damage):
    data = TASKS.get("digits-mlp").load_client(_cfg(), 0, 2)
    calls, compute = _counting(data)
    ready_client_data("x", {"k": 1}, compute)
    (folder,) = _folders()
    array = folder / "train_x.npy"
    if damage == "truncate":  # a torn copy, a full disk
        array.write_bytes(array.read_bytes()[: array.stat().st_size // 2])
    elif damage == "garbage":
        array.write_bytes(b"\x93NUMPY garbage")
    elif damage == "no-meta":
        (folder / META).unlink()
    elif damage == "bad-meta":
        (folder / META).write_text("{")
    elif damage == "wrong-shape":
        meta = json.loads((folder / META).read_text())
        meta["arrays"]["train_y"]["shape"] = [1]
        (folder / META).write_text(json.dumps(meta))
    else:
        (folder / "test_y.npy").unlink()
    assert read_ready(folder) is None
    got = ready_client_data("x", {"k": 1}, compute)
    assert calls == [1, 1]  # recomputed
    assert_same_data(got, data)
    assert read_ready(folder) is not None  # and rewritten whole
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [META, *(f"{name}.npy" for name in ARRAYS)]
    )


def test_data_not_held_as_tensors_is_computed_every_time():
    class Items(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int):
            return torch.zeros(1), 0

    data = ClientData(Items(), Items())
    calls, compute = _counting(data)
    assert ready_client_data("x", {"k": 1}, compute) is data
    assert ready_client_data("x", {"k": 1}, compute) is data
    assert calls == [1, 1] and not any(p.iterdir() for p in _folders())


def test_an_unwritable_cache_only_costs_the_speed_up(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be
    monkeypatch.setenv("FEDADAPT_CACHE_DIR", str(blocker / "sub"))
    data = TASKS.get("digits-mlp").load_client(_cfg(), 0, 2)
    calls, compute = _counting(data)
    assert ready_client_data("x", {"k": 1}, compute) is data
    assert ready_client_data("x", {"k": 1}, compute) is data
    assert calls == [1, 1]


def test_data_path_nodes_read_ready_files_and_see_changed_data(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.random((20, 64), dtype=np.float32), rng.integers(0, 10, 20)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    cfg = _cfg()
    oracle = load_node_data(path, cfg)  # no ready files: read and checked
    node_data_module._load.cache_clear()
    load_node_data(path, cfg, ready=True)  # writes
    node_data_module._load.cache_clear()
    got = load_node_data(path, cfg, ready=True)  # reads
    assert len(_folders()) == 1
    assert_same_data(got, oracle)
    np.savez(path, x=x[:10], y=y[:10])  # the node's data changed
    os.utime(path, ns=(10**18, 10**18))  # (even within one mtime tick)
    node_data_module._load.cache_clear()
    assert len(load_node_data(path, cfg, ready=True).train) == 8
    assert len(_folders()) == 2


def test_folders_unused_for_two_weeks_go_with_the_next_write():
    """A read marks a folder used; a write removes the long unused ones only."""
    cfg = validate_run_config({"task": "digits-mlp"})
    task = TASKS.get("digits-mlp")
    compute = lambda: task.load_client(cfg, 0, 3)  # noqa: E731
    ready_client_data("old", {"k": 1}, compute)
    ready_client_data("used", {"k": 2}, compute)
    (old,) = ready_dir().glob("old-*")
    (used,) = ready_dir().glob("used-*")
    half_written = ready_dir() / "half-x"  # no meta.json yet, just made
    half_written.mkdir()
    long_ago = time.time() - (KEEP_DAYS + 1) * 86400
    for folder in (old, used):
        os.utime(folder / META, (long_ago, long_ago))
    assert read_ready(used) is not None  # read now: used again
    ready_client_data("new", {"k": 3}, compute)  # a write prunes
    assert not old.exists()
    assert used.exists() and half_written.exists()
    assert len(list(ready_dir().glob("new-*"))) == 1
