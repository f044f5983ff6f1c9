"""What a node's messages say about the node, without PyTorch.

The node config's partition or data path and the server's numeric config
values, read by the ClientApp before any training code is imported (a
``flwr-clientapp`` process that answers a query, or hands a message to
its node's warm worker, never imports torch: :mod:`fedadapt.client.worker`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedadapt.strategies import wire

#: node-config key of a node's own data (:mod:`fedadapt.tasks.node_data`)
DATA_PATH = wire.DATA_PATH


def config_number(value: object) -> float:
    """Return a numeric value of the server's train config, or raise TypeError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number in the train config, got {value!r}")
    return float(value)


def data_path_of(node_config: Mapping[str, Any]) -> str | None:
    """Return node-config ``data-path`` (the node's own data), or None."""
    value = node_config.get(DATA_PATH)
    return None if value is None or str(value) == "" else str(value)


def partition_of(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """Return (partition-id, num-partitions) from a SuperNode's node config.

    A node with its own data (``data-path``) needs no partition; without
    one it is (0, 1), which only seeds its shuffling.
    """
    if data_path_of(node_config) is not None and (wire.PARTITION_ID not in node_config):
        return 0, 1
    try:
        pid = int(node_config[wire.PARTITION_ID])
        num = int(node_config[wire.NUM_PARTITIONS])
    except KeyError as missing:
        raise ValueError(
            f"node config lacks {missing}; start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>" (a partition '
            "of the task's data) or --node-config 'data-path=\"<path>\"' (its own)"
        ) from None
    if not 0 <= pid < num:
        raise ValueError(f"partition-id {pid} is outside [0, num-partitions={num})")
    return pid, num


def partition_properties(node_config: Mapping[str, Any]) -> dict[str, int]:
    """Return the node's answer to the server's partition query.

    ``partition-id`` and ``num-partitions`` (the ServerApp's seeded sampling
    orders nodes by them); nothing for a node with only its own data
    (``data-path`` and no ``partition-id``: it is sampled after the
    numbered nodes).
    """
    if wire.PARTITION_ID not in node_config and data_path_of(node_config):
        return {}
    pid, num = partition_of(node_config)
    return {wire.PARTITION_ID: pid, wire.NUM_PARTITIONS: num}
