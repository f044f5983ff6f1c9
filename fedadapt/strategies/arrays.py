"""Flower ``Array`` bytes read in place: the wire format of a reply's arrays.

A client's reply carries its model as Flower ``Array`` objects holding
``.npy`` bytes. The server reads them one array at a time while the rule
sums them (:class:`LazyArrays`), each as a read-only NumPy view of the
serialised bytes (:func:`array_view`), not a copy, so a round holds no copy
of any reply; names, shapes and dtypes are checked from the metadata alone
(:func:`array_specs`). Flower's ``Array.numpy()`` (``np.load``, a copy) is
the fallback for anything the view does not cover; it costs a round of
ResNet-18 replies about three times the zero-copy pass (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray


class ReplyError(ValueError):
    """A reply's data contradicts what it declared (raised mid-aggregation)."""

    def __init__(self, arrays: LazyArrays, reason: str) -> None:
        super().__init__(reason)
        self.arrays = arrays
        self.reason = reason


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: np.dtype[Any]) -> str:
    """Return ``str(dtype)``, cached.

    ``numpy.dtype.__str__`` is slow, and a round compares the dtypes of
    every array of every reply.
    """
    return str(dtype)


#: The ``.npy`` magic string and the ``stype`` Flower gives such bytes.
_NPY_MAGIC = b"\x93NUMPY"
_NPY_STYPE = "numpy.ndarray"


@functools.lru_cache(maxsize=4096)
def _npy_header(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], bool] | None:
    """Parse one ``.npy`` header (magic to end of header) with NumPy's reader.

    Cached: every client sends the same few hundred headers each round.
    None for anything :func:`array_view` leaves to ``Array.numpy()``.
    """
    stream = io.BytesIO(header)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            return None
    except ValueError:
        return None
    if dtype.hasobject or stream.tell() != len(header):
        return None
    return dtype, shape, fortran


def array_view(item: Any) -> NDArray[Any]:
    """Return a Flower ``Array``'s values as a read-only view of its bytes.

    The same array ``item.numpy()`` gives (``np.load``, no pickles), without
    copying the data: the header is parsed by NumPy's own ``.npy`` reader and
    the values are ``np.frombuffer`` over the rest, which must hold exactly
    ``prod(shape)·itemsize`` bytes. Anything else (another ``stype``, format
    version 3, object dtypes, a size mismatch, or objects that are not
    Flower Arrays) goes through ``item.numpy()`` and its errors.
    """
    data = getattr(item, "data", None)
    if (
        getattr(item, "stype", None) != _NPY_STYPE
        or not isinstance(data, bytes)
        or not data.startswith(_NPY_MAGIC)
        or len(data) < 10
    ):
        return item.numpy()
    length_bytes = 2 if data[6] == 1 else 4
    start = 8 + length_bytes
    end = start + int.from_bytes(data[8:start], "little")
    parsed = _npy_header(data[:end]) if end <= len(data) else None
    if parsed is None:
        return item.numpy()
    dtype, shape, fortran = parsed
    count = math.prod(shape)
    if len(data) - end != count * dtype.itemsize:
        return item.numpy()
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=end)
    return flat.reshape(shape, order="F" if fortran else "C")


class LazyArrays(Mapping[str, NDArray[Any]]):
    """A reply's arrays, deserialised on access and checked against their specs.

    ``record`` maps names to objects with ``numpy()``, ``shape`` and
    ``dtype`` (Flower's ``Array``); values are read-only views of the
    serialised bytes (:func:`array_view`). Reading an array whose data disagree with
    its declared shape or dtype raises :class:`ReplyError`.
    """

    def __init__(self, record: Mapping[str, Any]) -> None:
        self._record = record

    def __getitem__(self, key: str) -> NDArray[Any]:
        item = self._record[key]
        array = array_view(item)
        if array.shape != tuple(item.shape) or dtype_name(array.dtype) != str(
            item.dtype
        ):
            raise ReplyError(self, f"array '{key}' data do not match its metadata")
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._record)

    def __len__(self) -> int:
        return len(self._record)

    def specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Return the declared (shape, dtype) of every array, without deserialising."""
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in self._record.items()}


def array_specs(arrays: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Return {name: (shape, dtype)} of plain or lazy arrays."""
    if isinstance(arrays, LazyArrays):
        return arrays.specs()
    return {k: (tuple(a.shape), dtype_name(a.dtype)) for k, a in arrays.items()}


def all_finite(arrays: Mapping[str, NDArray[Any]]) -> bool:
    """Whether every float array is free of NaN/Inf (a sum overflows to inf)."""
    return all(
        math.isfinite(float(np.sum(a))) for a in arrays.values() if a.dtype.kind in "fc"
    )
