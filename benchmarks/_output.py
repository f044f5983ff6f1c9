"""Writing a benchmark's figures: one JSON file, replaced atomically.

A benchmark stopped while it writes (Ctrl-C, a timeout) must not leave a
half-written results file that a later reader takes for figures, and two
runs given the same file must not overwrite each other's (:func:`owned`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedadapt._atomic import atomic_write_text, try_lock


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (folders made), atomically, and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(payload, indent=1) + "\n")
    print(f"written: {path}")


class OutputBusyError(RuntimeError):
    """Another benchmark run is writing the same results file."""


@contextlib.contextmanager
def owned(path: Path) -> Iterator[None]:
    """Hold ``path`` for this run: a second run given the same file is refused.

    The lock (``.<name>.lock`` beside it, ``flock``) goes with the process,
    so a run that was killed blocks no later one; a run that ends removes
    the file. The lock file
    names the holder's pid for the error message.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.parent / f".{path.name}.lock"
    fd = try_lock(lock)
    if fd is None:
        holder = lock.read_text().strip() or "?"
        raise OutputBusyError(
            f"{path} is being written by another run (pid {holder}); "
            "give this one a different output file"
        )
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        # removed while still held: a run that opened it meanwhile finds
        # the file gone after locking and takes a new one (try_lock)
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)
