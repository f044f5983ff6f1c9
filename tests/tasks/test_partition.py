"""Partition statistics: coverage, determinism, skew, class counts.

The Δ-SGD sampler follows the authors' code (``sampling.py``) of the Dirichlet
split that Δ-SGD (arXiv:2306.11201) §4 and App. B.2 describe; the equal-size
sampler is the FedExP code's, our reading of FedDuA §5.1's unstated split.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedadapt.tasks.partition import (
    PARTITIONS,
    client_indices,
    delta_sgd_partition,
    dirichlet_partition,
    equal_dirichlet_partition,
    iid_partition,
    shard_partition,
    train_test_split_indices,
)

LABELS = np.repeat(np.arange(10), 200)  # 2,000 samples, 10 balanced classes


def _assert_exact_cover(parts, n):
    merged = np.concatenate(parts)
    assert len(merged) == n
    assert np.array_equal(np.sort(merged), np.arange(n))


def _mean_label_skew(parts, labels):
    """Mean total-variation distance between client and global label shares."""
    global_share = np.bincount(labels, minlength=10) / len(labels)
    return np.mean(
        [
            0.5
            * np.abs(np.bincount(labels[p], minlength=10) / len(p) - global_share).sum()
            for p in parts
        ]
    )


@pytest.mark.parametrize("alpha", [0.1, 0.5, 10.0])
def test_dirichlet_assigns_every_sample_exactly_once(alpha):
    parts = dirichlet_partition(LABELS, 10, alpha, seed=3)
    _assert_exact_cover(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 10


@pytest.mark.parametrize(
    "split",
    [
        lambda s: iid_partition(LABELS, 10, s),
        lambda s: dirichlet_partition(LABELS, 10, 0.5, s),
        lambda s: equal_dirichlet_partition(LABELS, 10, 0.5, s),
        lambda s: shard_partition(LABELS, 10, 2, s),
        lambda s: delta_sgd_partition(LABELS, 10, 0.5, 100, s),
    ],
)
def test_same_seed_same_partition_other_seed_differs(split):
    a, b, c = split(1), split(1), split(2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_smaller_alpha_gives_more_label_skew():
    skew = {
        alpha: np.mean(
            [_mean_label_skew(dirichlet_partition(LABELS, 10, alpha, s), LABELS)
             for s in range(5)]
        )
        for alpha in (0.1, 1.0, 100.0)
    }  # fmt: skip
    assert skew[0.1] > skew[1.0] + 0.15 > skew[100.0] + 0.15
    assert skew[100.0] < 0.1  # nearly IID


def test_dirichlet_impossible_request_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 10 samples"):
        dirichlet_partition(LABELS[:50], 10, 0.5, seed=0)
    with pytest.raises(ValueError, match="Invalid alpha"):
        dirichlet_partition(LABELS, 10, 0.0, seed=0)


def test_iid_is_an_exact_near_equal_cover():
    labels = np.resize(LABELS, 1003)
    parts = iid_partition(labels, 10, seed=0)
    _assert_exact_cover(parts, 1003)
    assert {len(p) for p in parts} == {100, 101}
    assert _mean_label_skew(parts, labels) < 0.15


def test_equal_dirichlet_gives_equal_disjoint_clients_with_skew():
    """FedExP code's equal-size sampler: exactly N/n per client, disjoint."""
    parts = equal_dirichlet_partition(LABELS, 10, 0.3, seed=0)
    _assert_exact_cover(parts, len(LABELS))
    assert {len(p) for p in parts} == {200}
    assert _mean_label_skew(parts, LABELS) > 0.3


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_give_exactly_k_classes(k):
    parts = shard_partition(LABELS, 10, k, seed=0)
    assert all(len(np.unique(LABELS[p])) == k for p in parts)
    _assert_exact_cover(parts, len(LABELS))
    if k == 1:  # Fed-LAMB non-iid MNIST: one digit per device, 5 devices per digit
        many = shard_partition(LABELS, 50, 1, seed=0)
        owners = np.bincount([int(LABELS[p][0]) for p in many], minlength=10)
        assert owners.tolist() == [5] * 10


def test_delta_sgd_sampler_matches_the_papers_code():
    """Δ-SGD code: counts round(n·q), remainder to the last class, with replacement."""
    alpha, n, seed = 0.5, 500, 7
    parts = delta_sgd_partition(LABELS, 4, alpha, n, seed)
    rng = np.random.default_rng(seed)  # step-by-step reference of sampling.py
    members = [np.flatnonzero(LABELS == c) for c in range(10)]
    for part in parts:
        q = rng.dirichlet(alpha * np.full(10, 0.1))
        counts = np.round(n * q).astype(int)
        counts[-1] = n - counts[:-1].sum()
        draws = [
            rng.choice(m, size=k, replace=True)
            for m, k in zip(members, counts, strict=True)
            if k > 0
        ]
        expected = np.sort(np.concatenate(draws))
        assert len(part) == n
        np.testing.assert_array_equal(part, expected)
        np.testing.assert_array_equal(np.bincount(LABELS[part], minlength=10), counts)


def test_registry_and_cache_agree(cfg):
    config = cfg(partition="dirichlet", dirichlet_alpha=0.5, seed=4)
    direct = PARTITIONS.get("dirichlet")(LABELS, 10, config)
    for i in range(10):
        np.testing.assert_array_equal(client_indices(LABELS, 10, i, config), direct[i])


def test_local_train_test_split():
    indices = np.arange(100, 150)
    train, test = train_test_split_indices(indices, 0.2, seed=0)
    assert len(test) == 10 and len(train) == 40
    assert np.array_equal(np.sort(np.concatenate([train, test])), indices)
    tiny_train, tiny_test = train_test_split_indices(np.array([7]), 0.9, seed=0)
    assert list(tiny_train) == [7] and len(tiny_test) == 0


_IN_A_NEW_PROCESS = """
import sys
import numpy as np
from fedadapt.tasks.partition import client_indices
labels = np.random.default_rng(0).integers(0, 10, 2000)
cfg = {"partition": "dirichlet", "dirichlet-alpha": 0.3, "samples-per-client": 1,
       "classes-per-client": 2, "seed": 4}
parts = [client_indices(labels, 7, i, cfg).tolist() for i in range(7)]
print(repr((parts, "flwr_datasets" in sys.modules)))
"""


def _partition_in_new_process(cache):
    import ast
    import os
    import subprocess
    import sys

    env = {**os.environ, "FEDADAPT_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", _IN_A_NEW_PROCESS], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return ast.literal_eval(done.stdout.strip())


def test_partition_is_computed_once_per_machine_not_per_process(tmp_path):
    """Deployment starts a ClientApp process per message: the second process
    reads the partition from disk, without importing flwr-datasets."""
    first, imported = _partition_in_new_process(tmp_path)
    assert imported and len(list((tmp_path / "partitions").glob("*.npz"))) == 1
    again, imported_again = _partition_in_new_process(tmp_path)
    assert again == first and not imported_again


def test_damaged_cache_file_is_recomputed(tmp_path):
    first, _ = _partition_in_new_process(tmp_path)
    (cached,) = (tmp_path / "partitions").glob("*.npz")
    cached.write_bytes(b"not a zip file")
    again, imported = _partition_in_new_process(tmp_path)
    assert again == first and imported  # recomputed with flwr-datasets
    assert np.load(cached)["arr_0"].tolist() == first[0]  # and written back
