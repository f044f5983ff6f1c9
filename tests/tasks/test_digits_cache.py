"""The digits split, cached: the same tensors as scikit-learn's, without it.

Oracle: the split computed here with scikit-learn directly (the task's own
recipe: /16, stratified 20 %, random_state 0).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fedadapt.tasks import digits


def _sklearn_split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDADAPT_CACHE_DIR", str(tmp_path))
    digits.load_digits_split.cache_clear()
    yield tmp_path
    digits.load_digits_split.cache_clear()


def _assert_is_the_sklearn_split(train, test):
    x_tr, x_te, y_tr, y_te = _sklearn_split()
    np.testing.assert_array_equal(train.tensors[0].numpy(), x_tr)
    np.testing.assert_array_equal(train.tensors[1].numpy(), y_tr)
    np.testing.assert_array_equal(test.tensors[0].numpy(), x_te)
    np.testing.assert_array_equal(test.tensors[1].numpy(), y_te)
    assert train.tensors[0].dtype == test.tensors[0].dtype  # float32 both ways


def test_the_split_is_written_once_and_read_back_the_same(fresh_cache):
    _assert_is_the_sklearn_split(*digits.load_digits_split())  # computed, written
    files = list(fresh_cache.rglob("digits-split-*.npz"))
    assert len(files) == 1
    digits.load_digits_split.cache_clear()
    _assert_is_the_sklearn_split(*digits.load_digits_split())  # read back


def test_a_process_with_the_file_does_not_import_scikit_learn(fresh_cache):
    digits.load_digits_split()  # writes the file
    code = (
        "import sys; from fedadapt.tasks import digits; "
        "train, test = digits.load_digits_split(); "
        "print(len(train), len(test), 'sklearn' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["1437", "360", "False"]


def test_a_damaged_file_is_made_again(fresh_cache):
    digits.load_digits_split()
    (path,) = fresh_cache.rglob("digits-split-*.npz")
    path.write_bytes(b"not an npz")
    digits.load_digits_split.cache_clear()
    _assert_is_the_sklearn_split(*digits.load_digits_split())
    with np.load(path) as saved:  # and written again, whole
        assert len(saved["x_train"]) == 1437
