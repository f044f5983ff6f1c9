"""Bytes sent to and received from each client in a round's training (#29).

Both adapters (Message API and legacy) measure what actually travels, the
same way, and put it into the round's report (results.json ``communication``):

- **arrays**: the serialized arrays, ``len(Array.data)`` of every Array in
  the message's ArrayRecords (Message API) or ``len(tensor)`` of every
  tensor of the legacy ``Parameters``. Both are NumPy's ``.npy`` bytes
  (``np.save``: the array's data plus a header, 128 bytes for up to a few
  dimensions), so a model of float32 arrays weighs Σ (4·size + 128). The
  model, a rule's arrays (Fed-LAMB's v̂ / v) and a local update's arrays
  (control variates, gradients) all count.
- **config** (sent) / **metrics** (received): the scalars, counted as
  Flower's ``ConfigRecord.count_bytes`` does: each key's length plus 8 bytes
  per number, 1 per bool, the length of a string (legacy: the fit config,
  and the fit metrics with ``num-examples``, which the legacy reply carries
  apart).

Record names, message headers and transport framing are not counted (our
choice: they do not depend on the algorithm). Only training is counted;
federated evaluation sends the model again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["RoundTraffic", "scalar_bytes"]


def scalar_bytes(values: Mapping[str, Any]) -> int:
    """Bytes of a config or metrics mapping, as Flower's ``count_bytes`` counts.

    Key length + 8 per int/float, 1 per bool, ``len`` of a str/bytes value;
    a list counts each element so.
    """
    total = 0
    for key, value in values.items():
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, bool):
                total += 1
            elif isinstance(item, str | bytes):
                total += len(item)
            else:
                total += 8
        total += len(key)
    return total


class RoundTraffic:
    """Bytes per node of one round's training: sent and received."""

    def __init__(self) -> None:
        self.sent: dict[str, dict[str, int]] = {}
        self.received: dict[str, dict[str, int]] = {}

    def add_sent(self, node: int | str, arrays: Iterable[bytes], config: int) -> None:
        """Count a train message to ``node``: its arrays' bytes and config."""
        self.sent[str(node)] = {"arrays": sum(map(len, arrays)), "config": config}

    def add_received(
        self, node: int | str, arrays: Iterable[bytes], metrics: int
    ) -> None:
        """Count a train reply from ``node``: its arrays' bytes and metrics."""
        self.received[str(node)] = {
            "arrays": sum(map(len, arrays)),
            "metrics": metrics,
        }

    def as_dict(self) -> dict[str, Any]:
        """Per node and summed: ``sent``, ``received``, ``*_bytes`` totals."""

        def total(per_node: Mapping[str, Mapping[str, int]]) -> int:
            return sum(sum(parts.values()) for parts in per_node.values())

        return {
            "sent": dict(self.sent),
            "received": dict(self.received),
            "sent_bytes": total(self.sent),
            "received_bytes": total(self.received),
        }
