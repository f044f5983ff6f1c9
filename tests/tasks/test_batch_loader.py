"""batch_loader: a batch at a time, the same batches as torch's DataLoader."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from fedadapt.tasks.base import TensorRows, batch_loader


def _data() -> TensorDataset:
    x = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    return TensorDataset(x, torch.arange(40) % 7)


def _epochs(loader: DataLoader, epochs: int) -> list[list[torch.Tensor]]:
    return [list(batch) for _ in range(epochs) for batch in loader]


def test_shuffled_subset_gives_the_same_batches_over_epochs() -> None:
    # oracle: torch's own DataLoader, sample by sample, same seeded generator;
    # three epochs check that the generator is drawn from exactly as before
    subset = Subset(_data(), [3, 17, 5, 39, 0, 22, 8, 8, 11, 30, 2])
    plain = DataLoader(
        subset, 4, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    fast = batch_loader(
        subset, 4, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    assert isinstance(fast.dataset, TensorRows)
    expected, found = _epochs(plain, 3), _epochs(fast, 3)
    assert len(found) == len(expected) == 9
    for want, got in zip(expected, found, strict=True):
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_sequential_tensor_dataset_and_other_datasets() -> None:
    data = _data()
    expected = list(DataLoader(data, 16))
    found = list(batch_loader(data, 16))
    assert [len(b[0]) for b in found] == [16, 16, 8]
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(expected, found, strict=True)
    )
    other = [(torch.ones(2), 1)] * 5  # not tensors: torch's own path
    assert not isinstance(batch_loader(other, 2).dataset, TensorRows)
    assert len(list(batch_loader(other, 2))) == 3
