"""Errors a user can act on, shared by the run config and the registries.

Kept apart so that :mod:`fedadapt.config` (which lists registry names) and
:mod:`fedadapt.registry` (which raises on unknown names) do not import each
other.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A run-config value is unknown, of the wrong type or out of range."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"Invalid run-config '{key}': {message}")
        self.key = key


class PartitionQueryError(RuntimeError):
    """Seeded sampling cannot order the nodes: a node's partition-id is unknown.

    Raised instead of sampling differently from a rerun: some nodes did not
    answer the partition-id query before ``round-timeout``, answered with an
    invalid partition-id, or their ClientApp failed on the query. ``key`` is
    the run-config key the message tells the user to change, ``nodes`` the
    nodes concerned.
    """

    def __init__(self, key: str, nodes: list[str], message: str) -> None:
        super().__init__(message)
        self.key = key
        self.nodes = nodes
