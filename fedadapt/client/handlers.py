"""The ClientApp's train and evaluate work: PyTorch, on a message's content.

:mod:`fedadapt.client.client_app` hands each train / evaluate message's
content and the node's context here, in its own process or through the
node's warm worker (:mod:`fedadapt.client.worker`); what comes back is the
reply's content. The node's ``context.state`` (a local update's client
state) is updated in place.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import SType

from fedadapt.client import legacy_training
from fedadapt.client.local import evaluate_round, train_round
from fedadapt.client.node import config_number, data_path_of, partition_of
from fedadapt.config import validate_run_config
from fedadapt.strategies import wire
from fedadapt.strategies.arrays import array_view, dtype_name


def _numpy(record: ArrayRecord | None) -> dict[str, Any] | None:
    return None if record is None else {k: v.numpy() for k, v in record.items()}


@lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """Return the ``.npy`` header ``np.save`` writes for a C-ordered array (cached)."""
    buffer = io.BytesIO()
    empty = np.empty(shape, dtype)
    np.save(buffer, empty, allow_pickle=False)
    return buffer.getvalue()[: buffer.tell() - empty.nbytes]


def _array(values: np.ndarray) -> Array:
    """Flower's ``Array(values)``, the same bytes, with the header written once.

    Flower's ``np.save`` per array formats its header every time (a fifth of
    a millisecond a small model's reply); a model's shapes repeat.
    """
    if not values.flags.c_contiguous or values.dtype.hasobject:
        return Array(values)
    header = _npy_header(values.dtype, values.shape)
    return Array(
        dtype=dtype_name(values.dtype),
        shape=tuple(values.shape),
        stype=SType.NUMPY,
        data=header + values.tobytes(),
    )


def _record(arrays: Mapping[str, Any]) -> ArrayRecord:
    return ArrayRecord({k: _array(v) for k, v in arrays.items()})


def _state_dict(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``'s tensors, without ``np.load`` per array.

    The values are read as views of the bytes (headers parsed once per
    shape, :func:`~fedadapt.strategies.arrays.array_view`) and copied once
    into writable tensors.
    """
    return {k: torch.from_numpy(array_view(v).copy()) for k, v in record.items()}


def train(content: RecordDict, context: Context) -> RecordDict:
    """Train on the local partition; reply with weights and metrics.

    When the train config sets ``evaluate-first`` (federated evaluation
    folded into the train exchange, run-config
    ``federated-eval-exchange``), the received model is first evaluated
    exactly as :func:`evaluate` does, and the scores travel as a second
    MetricRecord, ``evaluate-metrics``, beside the train metrics.
    """
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    records = content.array_records
    config = content.config_records.get(wire.CONFIG, ConfigRecord())
    received = _state_dict(records[wire.ARRAYS])
    scores = None
    if config.get(wire.EVALUATE_FIRST, False):
        scores = _evaluate(cfg, pid, num, received, context)
    result = train_round(
        cfg,
        pid,
        num,
        received,
        lr=config_number(config.get(wire.LR, cfg["client-lr"])),
        server_round=int(config_number(config.get(wire.SERVER_ROUND, 0))),
        config=config,
        local_arrays=_numpy(records.get(wire.LOCAL_ARRAYS)),
        client_state=context.state,
        data_path=data_path_of(context.node_config),
        node_id=context.node_id,
    )
    reply = RecordDict(
        {
            wire.ARRAYS: _record({k: v.numpy() for k, v in result.state.items()}),
            wire.METRICS: MetricRecord(dict(result.metrics)),
        }
    )
    if scores is not None:
        reply[wire.EVALUATE_METRICS] = scores
    if result.local_arrays is not None:
        reply[wire.LOCAL_ARRAYS] = _record(result.local_arrays)
    return reply


def evaluate(content: RecordDict, context: Context) -> RecordDict:
    """Evaluate the received global model on the local test split."""
    cfg = validate_run_config(context.run_config)
    pid, num = partition_of(context.node_config)
    state = _state_dict(content.array_records[wire.ARRAYS])
    return RecordDict({wire.METRICS: _evaluate(cfg, pid, num, state, context)})


def _evaluate(
    cfg: Mapping[str, Any],
    pid: int,
    num: int,
    state: Mapping[str, torch.Tensor],
    context: Context,
) -> MetricRecord:
    """Return this node's evaluation of ``state``: evaluate and folded train."""
    scores = evaluate_round(
        cfg,
        pid,
        num,
        state,
        data_path=data_path_of(context.node_config),
        node_id=context.node_id,
    )
    return MetricRecord(dict(scores))


#: what a node's worker runs, by kind: the Message-API ClientApp's train and
#: evaluate, and the legacy NumPyClient's fit and evaluate
HANDLERS: dict[str, Callable[[Any, Context], Any]] = {
    "train": train,
    "evaluate": evaluate,
    "legacy-fit": legacy_training.fit,
    "legacy-evaluate": legacy_training.evaluate,
}
