"""The per-process cache of a client's data (#30): once per run config and
partition, never shared between runs whose settings differ. (Outside Ray
the data may come from the node's ready files, #40: compared by value.)"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from fedadapt.client.local import client_data
from fedadapt.config import validate_run_config
from fedadapt.tasks import TASKS
from fedadapt.tasks.ready_data import dataset_arrays


def _same(got: Dataset, want: Dataset) -> bool:
    (gx, gy), (wx, wy) = dataset_arrays(got), dataset_arrays(want)  # type: ignore[misc]
    return np.array_equal(gx, wx) and np.array_equal(gy, wy)


def _rows(cfg: dict, pid: int, num: int) -> list[torch.Tensor]:
    data = client_data(cfg, pid, num)
    return [data.train[i][1] for i in range(len(data.train))]


def test_cached_data_is_what_the_task_loads() -> None:
    cfg = validate_run_config({"task": "digits-mlp", "partition": "iid"})
    first = client_data(cfg, 3, 10)
    assert client_data(dict(cfg), 3, 10) is first  # served from the cache
    fresh = TASKS.get("digits-mlp").load_client(cfg, 3, 10)  # the oracle
    assert _same(first.train, fresh.train) and _same(first.test, fresh.test)


def test_no_leak_between_configs_or_partitions() -> None:
    iid = validate_run_config({"task": "digits-mlp", "partition": "iid"})
    skew = {**iid, "partition": "delta-sgd", "samples-per-client": 20}
    reseeded = {**iid, "seed": 7}
    loaded = TASKS.get("digits-mlp").load_client
    for cfg in (iid, skew, reseeded):
        for pid, num in ((0, 10), (1, 10), (0, 5)):
            got = client_data(cfg, pid, num)
            assert _same(got.train, loaded(cfg, pid, num).train)
    # the settings change the split, so a shared entry would have shown above
    assert _rows(iid, 0, 10) != _rows(skew, 0, 10)
    assert not _same(client_data(iid, 0, 10).train, client_data(reseeded, 0, 10).train)


def test_a_config_json_cannot_hold_is_loaded_uncached() -> None:
    cfg = {**validate_run_config({"task": "digits-mlp", "partition": "iid"})}
    cfg["extra"] = object()  # not JSON: no cache key, but still the right data
    got = client_data(cfg, 2, 10)
    want = TASKS.get("digits-mlp").load_client(cfg, 2, 10)
    assert _same(got.train, want.train)
