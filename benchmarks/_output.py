"""Writing a benchmark's figures: one JSON file, replaced atomically.

A benchmark stopped while it writes (Ctrl-C, a timeout) must not leave a
half-written results file that a later reader takes for figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedadapt._atomic import atomic_write_text


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (folders made), atomically, and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(payload, indent=1) + "\n")
    print(f"written: {path}")
