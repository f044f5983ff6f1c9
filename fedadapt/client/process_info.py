"""Process start times and ages (this one and others), from Linux's /proc.

Standard library only (a one-message ``flwr-clientapp`` process imports it
before anything heavy). Where /proc is missing the answers are None and
every process whose pid exists counts as alive.
"""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """Return ``/proc/<pid>/stat``'s fields after the command name, or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """Return a process's start time (clock ticks after boot), None if unknown."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])
    except (ValueError, IndexError):
        return None


def process_age_s() -> float | None:
    """Return the seconds since this process started, or None where unknown.

    From Linux's ``/proc/self/stat`` (start time in clock ticks after boot)
    and ``/proc/uptime``: clients.jsonl's ``process_age_s``, which splits a
    deployment round's client time into the per-message process's start-up
    and its training (issue #40). None on other systems.
    """
    started = process_start_ticks(os.getpid())
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if started is None:
        return None
    return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))


def alive(pid: int, start_ticks: int | None) -> bool:
    """Return whether process ``pid`` (started at ``start_ticks``) still runs.

    A zombie (ended, not yet reaped by its parent) counts as ended; so does
    a process whose start time differs (the pid was reused).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, someone else's
    fields = _stat_fields(pid)
    if fields is not None and fields[0] in ("Z", "X"):
        return False
    return start_ticks is None or process_start_ticks(pid) == start_ticks
