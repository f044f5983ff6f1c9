"""Partition statistics: coverage, determinism, skew, minimum sizes."""

from __future__ import annotations

import numpy as np
import pytest

from fedadapt.tasks.partition import (
    dirichlet_partition,
    iid_partition,
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


def test_dirichlet_same_seed_same_partition_other_seed_differs():
    a = dirichlet_partition(LABELS, 10, 0.5, seed=1)
    b = dirichlet_partition(LABELS, 10, 0.5, seed=1)
    c = dirichlet_partition(LABELS, 10, 0.5, seed=2)
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
    parts = iid_partition(1003, 10, seed=0)
    _assert_exact_cover(parts, 1003)
    assert {len(p) for p in parts} == {100, 101}
    assert _mean_label_skew(parts, np.resize(LABELS, 1003)) < 0.15


def test_local_train_test_split():
    indices = np.arange(100, 150)
    train, test = train_test_split_indices(indices, 0.2, seed=0)
    assert len(test) == 10 and len(train) == 40
    assert np.array_equal(np.sort(np.concatenate([train, test])), indices)
    tiny_train, tiny_test = train_test_split_indices(np.array([7]), 0.9, seed=0)
    assert list(tiny_train) == [7] and len(tiny_test) == 0
