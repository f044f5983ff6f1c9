"""The ClientApp's own array conversions give Flower's bytes and values (#30:
they replace ``ArrayRecord(state)`` and ``to_torch_state_dict`` per message)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedadapt.client.handlers import _array, _record, _state_dict
from fedadapt.tasks import TASKS

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(7, dtype=np.int64),  # a 0-d buffer (BatchNorm's num_batches_tracked)
    np.zeros((0, 5), dtype=np.float64),
    np.arange(6, dtype=np.float16),
    np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not C-ordered: Flower's path
    np.array([True, False]),
]


def test_arrays_are_flowers_bytes():
    for values in ARRAYS:
        ours, flowers = _array(values), Array(values)
        assert ours.data == flowers.data, values.dtype
        assert (ours.dtype, ours.shape, ours.stype) == (
            flowers.dtype,
            flowers.shape,
            flowers.stype,
        )
        np.testing.assert_array_equal(ours.numpy(), values)


def test_a_models_record_round_trips_as_flowers():
    torch.manual_seed(0)
    state = TASKS.get("mnist5k-cnn").build_model().state_dict()
    ours = _record({k: v.numpy() for k, v in state.items()})
    flowers = ArrayRecord(state)
    assert list(ours) == list(flowers)
    for key in flowers:
        assert ours[key].data == flowers[key].data, key
    tensors = _state_dict(flowers)
    reference = flowers.to_torch_state_dict()
    assert list(tensors) == list(reference)
    for key, tensor in reference.items():
        assert tensors[key].dtype == tensor.dtype
        assert torch.equal(tensors[key], tensor), key
        tensors[key].add_(1)  # writable, and not the record's bytes
    assert flowers.to_torch_state_dict().keys() == reference.keys()
    for key, tensor in flowers.to_torch_state_dict().items():
        assert torch.equal(tensor, reference[key]), key
