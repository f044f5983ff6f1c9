"""Atomic file writes: a reader sees the old file or the new one, never a part.

Every file a run rewrites (results.json, curves.png, checkpoints, the Flower
connection file, the partition cache, nodes' ready data files) goes through
:func:`atomic_open`: the content is written to a temporary file with a
unique name in the same folder (``tempfile.mkstemp``, so concurrent writers
never share one), flushed and fsync'ed, then renamed over the target with
``os.replace``. A failed write leaves the previous file untouched and removes
its temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file that replaces ``path`` when the block ends.

    ``mode`` is ``"wb"`` or ``"w"`` (UTF-8 text). If the block raises, the
    target is left as it was.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: mode must be 'wb' or 'w', got {mode!r}")
    target = Path(path)
    fd, tmp = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
    )
    try:
        encoding = "utf-8" if mode == "w" else None
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; keep the usual mode
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def try_lock(path: str | Path) -> int | None:
    """Take the exclusive lock ``path`` without waiting; its fd, or None if busy.

    The file is re-checked after locking: if it was replaced meanwhile, the
    lock on the old inode means nothing and the attempt is repeated.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: read once at import (os.umask is process-wide: toggling it per write would
#: race with other threads creating files)
_UMASK = _current_umask()


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
