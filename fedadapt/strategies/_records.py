"""Nested strategy state <-> Flower records (and bytes on disk).

A strategy's state is a tree of dicts whose leaves are NumPy arrays,
Python scalars (``bool``, ``int``, ``float``, ``str``) and ``None``
(moments not initialised yet). Flower's records are flat: an
``ArrayRecord`` holds arrays, a ``ConfigRecord`` scalars. The tree becomes

- ``<name>.arrays`` (ArrayRecord): every array leaf, keyed by its path
  joined with ``/`` (``rule/v/fc.weight``), dtype and shape kept exactly
  (NumPy scalars are stored as 0-d arrays, so their dtype survives too);
- ``<name>.values`` (ConfigRecord): every scalar leaf, keyed the same way;
- ``<name>.layout`` (ConfigRecord): ``layout``, the tree's shape as JSON
  (which keys are dicts, arrays, scalars or None) and ``format``.

So a state survives ``context.state`` and Flower's protobuf serialisation
(:func:`records_to_bytes`) bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from numpy.typing import NDArray

FORMAT = 1
_ARRAY, _SCALAR, _NONE = "array", "scalar", "none"


def state_to_records(state: Mapping[str, Any], name: str) -> RecordDict:
    """Return ``state`` (a tree of dicts) as a RecordDict of three records."""
    arrays: dict[str, Array] = {}
    values: dict[str, Any] = {}

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            for key in node:
                if not isinstance(key, str):
                    raise TypeError(f"state key {key!r} at {path} is not a str")
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        key = "/".join(path)
        if key in arrays or key in values:
            raise ValueError(f"two state entries share the record key {key!r}")
        if node is None:
            return _NONE
        if isinstance(node, np.ndarray | np.generic):
            arrays[key] = Array(np.array(node, order="C"))
            return _ARRAY
        if isinstance(node, bool | int | float | str):
            values[key] = node
            return _SCALAR
        raise TypeError(
            f"state entry {key!r} is a {type(node).__name__}; records hold "
            "arrays, bool/int/float/str and None"
        )

    layout = walk(state, ())
    return RecordDict(
        {
            f"{name}.arrays": ArrayRecord(arrays),
            f"{name}.values": ConfigRecord(values),
            f"{name}.layout": ConfigRecord(
                {"layout": json.dumps(layout), "format": FORMAT}
            ),
        }
    )


def state_from_records(records: RecordDict, name: str) -> dict[str, Any]:
    """Rebuild the tree :func:`state_to_records` stored under ``name``.

    Raises ValueError naming the missing record when ``records`` holds no
    such state (or one of another format).
    """
    try:
        arrays = records.array_records[f"{name}.arrays"]
        values = records.config_records[f"{name}.values"]
        layout_record = records.config_records[f"{name}.layout"]
    except KeyError as error:
        raise ValueError(
            f"no strategy state in these records: {error.args[0]!r} is missing "
            f"(expected what state_to_records(..., {name!r}) wrote)"
        ) from None
    if layout_record.get("format") != FORMAT:
        raise ValueError(f"{name}.layout has format {layout_record.get('format')!r}")

    def build(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: build(v, (*path, k)) for k, v in node.items()}
        key = "/".join(path)
        if node == _NONE:
            return None
        if node == _ARRAY:
            return arrays[key].numpy()
        return values[key]

    state = build(json.loads(str(layout_record["layout"])), ())
    assert isinstance(state, dict)
    return state


def records_to_bytes(records: RecordDict) -> bytes:
    """Serialise a RecordDict as Flower does on the wire (protobuf)."""
    from flwr.common.serde import recorddict_to_proto

    return bytes(recorddict_to_proto(records).SerializeToString())


def records_from_bytes(data: bytes) -> RecordDict:
    """Inverse of :func:`records_to_bytes`."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    return recorddict_from_proto(ProtoRecordDict.FromString(data))


def arrays_digest(arrays: Mapping[str, NDArray[Any]]) -> str:
    """Return a SHA-256 over names, dtypes, shapes and values (key order free)."""
    digest = hashlib.sha256()
    for key in sorted(arrays):
        array = np.asarray(arrays[key], order="C")
        digest.update(json.dumps([key, array.dtype.str, array.shape]).encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()
