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
