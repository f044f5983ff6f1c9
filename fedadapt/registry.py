"""Name → implementation registries selected through run-config.

Each registry lives beside what it registers (tasks in :mod:`fedadapt.tasks`,
client optimizers in :mod:`fedadapt.optimizers`, strategies with their
declarations in :mod:`fedadapt.strategies`). A later feature adds a name with
``@REGISTRY.register("name")``; the apps never change.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

from fedadapt.errors import ConfigError

T = TypeVar("T")

# run-config key → "module:attribute" of the registry that serves it
_REGISTRIES = {
    "task": "fedadapt.tasks:TASKS",
    "partition": "fedadapt.tasks.partition:PARTITIONS",
    "client-optimizer": "fedadapt.optimizers:OPTIMIZERS",
    "strategy": "fedadapt.strategies:ALGORITHMS",
    "local-update": "fedadapt.strategies.local_update:LOCAL_UPDATES",
}


class Registry(Generic[T]):
    """A mapping from names to implementations for one run-config key."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._items: dict[str, T] = {}
        self._frozen: str | None = None

    def freeze(self, why: str) -> None:
        """Refuse later registrations, saying ``why`` (what was built from it)."""
        self._frozen = why

    def register(self, name: str) -> Callable[[T], T]:
        """Register the decorated object under ``name``.

        Raises RuntimeError once the registry is frozen (:meth:`freeze`).
        """

        def decorator(obj: T) -> T:
            if self._frozen is not None:
                raise RuntimeError(
                    f"{self.key} {name!r} registered too late: {self._frozen}; "
                    "register it in a module imported before (see "
                    "docs/extending.md)"
                )
            if name in self._items:
                raise ValueError(f"{self.key} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the object registered as ``name`` or raise ConfigError."""
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                self.key,
                f"unknown value {name!r}. Valid values: {', '.join(self.names())}",
            ) from None

    def names(self) -> list[str]:
        """Return the registered names in registration order."""
        return list(self._items)


def lookup(key: str) -> Registry:  # type: ignore[type-arg]
    """Return the registry that serves run-config ``key``."""
    module_name, attribute = _REGISTRIES[key].split(":")
    return getattr(importlib.import_module(module_name), attribute)


def names(key: str) -> list[str]:
    """Return the valid names for run-config ``key``."""
    return lookup(key).names()
