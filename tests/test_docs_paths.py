"""Module paths that the docs name exist (#42: docs/algorithms.md listed
three paths under ``client.optim`` that had moved to ``optimizers``)."""

from __future__ import annotations

import importlib
import re

from tests.helpers import ROOT


def _resolves(dotted: str) -> bool:
    """Whether ``fedadapt.<dotted>`` is a module or an attribute of one."""
    parts = f"fedadapt.{dotted}".split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_module_path_in_the_papers_table_exists():
    text = (ROOT / "docs" / "algorithms.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    paths = [
        path
        for line in table
        for path in re.findall(
            r"`((?:strategies|optimizers|client|tasks)\.[\w.]+)`", line
        )
    ]
    assert len(paths) >= 8, paths
    missing = [p for p in paths if not _resolves(p)]
    assert missing == [], missing
