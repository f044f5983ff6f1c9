"""A run owns its folder: a lock held for the run's life, owner info, orphans.

The ServerApp process claims ``<output-dir>/<run-name>/`` before it writes
anything: it holds an exclusive ``flock`` on ``<run>/.lock`` until the run
is finished (the kernel drops it when the process dies, also on kill -9), and
records who it is (pid, host, boot id, process start time) in the lock file
and in results.json. So

- a second run into a live folder fails at start with one line naming it;
- a folder that holds a finished run (results.json present) is never
  overwritten unless run-config ``overwrite=true``, or the run resumes from a
  checkpoint in that same folder (``resume-from``);
- a reader that finds ``status: running`` but can take the lock knows the
  owner is gone and marks the run ``failed`` with the reason
  (:func:`settle`); the CLI marks a run it stopped ``stopped``, and one that
  Flower reports failed ``failed`` with the error from Flower's log
  (:func:`record_failure`).

See docs/failures.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedadapt._atomic import atomic_write_text, try_lock

LOCK_FILE = ".lock"
RESULTS_FILE = "results.json"
#: Flower's log of a run that failed, saved by whoever submitted it (the CLI)
FLOWER_LOG_FILE = "flower.log"
#: files of a previous run removed when ``overwrite=true`` replaces it
REPLACED_FILES = (
    "results.json",
    "curves.png",
    "checkpoint.pkl",
    "clients.jsonl",
    "clients.png",
    FLOWER_LOG_FILE,
)
#: statuses of a run that has ended
FINISHED = ("completed", "failed", "stopped")
#: seconds a claim retries a busy lock (a reader may hold it for a moment)
CLAIM_RETRY_S = 2.0


class RunFolderError(RuntimeError):
    """The run folder is in use or holds a run that may not be overwritten."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (None: ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: split after ")"
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # a zombie has ended, only not been reaped yet
        return None
    return int(fields[19])  # field 22


def owner_info() -> dict[str, Any]:
    """Who this process is, enough to tell later whether it still lives."""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "start_ticks": _start_ticks(pid),
    }


def owner_alive(owner: Mapping[str, Any]) -> bool | None:
    """Whether the recorded owner process still runs; None if not decidable here.

    Decidable on the owner's host (same hostname): after a reboot it is gone;
    a pid whose start time differs is another process that reused the pid.
    """
    if owner.get("host") != socket.gethostname():
        return None
    if owner.get("boot_id") != _boot_id():
        return False
    return _start_ticks(int(owner["pid"])) == owner.get("start_ticks")


def _may_take_over(owner: Mapping[str, Any]) -> bool:
    """Whether a free lock may be trusted to mean that ``owner`` is gone.

    On the owner's host the pid must be dead. An owner in a container on
    this kernel (same boot id, another hostname and pid namespace) holds a
    lock we see. An owner on another machine may hold a lock that a network
    or VM file system does not show here: never taken for dead (our choice).
    """
    alive = owner_alive(owner)
    if alive is None:
        return bool(owner.get("boot_id")) and owner.get("boot_id") == _boot_id()
    return not alive


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RunFolder:
    """A run folder claimed by this process (the lock is held until release)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        self.owner = owner_info()
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(self.owner) + "\n").encode())

    @classmethod
    def claim(
        cls, path: Path, overwrite: bool = False, resume_from: str = ""
    ) -> RunFolder:
        """Create and lock ``path`` for a new run, or fail naming it.

        Raises :class:`RunFolderError` when a live run holds the folder, or
        when it holds a run (results.json) and neither ``overwrite`` nor a
        ``resume_from`` checkpoint inside the folder allows taking it over.
        A run whose owner died while ``running`` is marked failed first.
        """
        path.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + CLAIM_RETRY_S
        while (fd := try_lock(path / LOCK_FILE)) is None:
            if time.monotonic() >= deadline:
                raise RunFolderError(
                    f"run folder {path} is in use by a live run{_who(path)}; choose "
                    "another run-name (or output-dir) or wait until that run ends"
                )
            time.sleep(0.05)
        try:
            previous = _read_json(path / RESULTS_FILE)
            previous = previous or {}
            if previous.get("status") == "running" and "owner" in previous:
                _mark(path, previous, "failed", orphan_reason(previous))
            resuming = bool(resume_from) and (
                Path(resume_from).expanduser().resolve().parent == path.resolve()
            )
            if (path / RESULTS_FILE).exists() and not resuming:
                if not overwrite:
                    status = previous.get("status", "unreadable")
                    raise RunFolderError(
                        f"run folder {path} already holds run "
                        f"{previous.get('run_id', '?')} (status {status}); "
                        "set another run-name, or overwrite=true to replace it"
                    )
                for name in REPLACED_FILES:
                    with contextlib.suppress(FileNotFoundError):
                        (path / name).unlink()
            elif not (path / RESULTS_FILE).exists():
                # Flower's log of an attempt that failed before writing results
                with contextlib.suppress(FileNotFoundError):
                    (path / FLOWER_LOG_FILE).unlink()
            return cls(path, fd)
        except BaseException:
            os.close(fd)
            raise

    @property
    def held(self) -> bool:
        """Whether this process still holds the folder."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock; remove the folder again if the run wrote nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if {p.name for p in self.path.iterdir()} == {LOCK_FILE}:
                (self.path / LOCK_FILE).unlink()
                self.path.rmdir()
        except OSError:
            pass  # somebody else's file appeared: keep the folder
        finally:
            os.close(fd)


def _who(path: Path) -> str:
    try:
        owner = json.loads((path / LOCK_FILE).read_text())
        return f" (pid {owner['pid']} on {owner['host']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def orphan_reason(data: Mapping[str, Any]) -> str:
    """Why a run still marked ``running`` whose owner is gone did not finish."""
    owner = data.get("owner") or {}
    rounds = len(data.get("rounds", []))
    return (
        f"the ServerApp (pid {owner.get('pid', '?')} on {owner.get('host', '?')}) "
        f"ended after {rounds} rounds without finishing the run (killed, or its "
        "machine stopped); resume from a checkpoint or start the run again"
    )


def _mark(path: Path, data: dict[str, Any], status: str, reason: str) -> None:
    data["status"] = status
    data["error"] = reason
    atomic_write_text(path / RESULTS_FILE, json.dumps(data, indent=2, default=str))


def _take_lock(
    run_dir: Path, owner: Mapping[str, Any] | None, wait: float
) -> int | None:
    """Lock the run folder once ``owner`` is gone (None: any owner let go).

    Retries for ``wait`` s; returns the lock's fd, or None if the owner
    still holds the folder (or may, see :func:`_may_take_over`).
    """
    deadline = time.monotonic() + wait
    while (owner is not None and not _may_take_over(owner)) or (
        fd := try_lock(run_dir / LOCK_FILE)
    ) is None:
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)
    return fd


def settle(
    run_dir: Path, status: str | None = None, reason: str = "", wait: float = 0.0
) -> dict[str, Any] | None:
    """Return the run's results, marking a ``running`` run whose owner is gone.

    With ``status`` (``stopped``/``failed``) and ``reason``, a run left
    ``running`` by a ServerApp that no longer holds the folder is marked so
    (the CLI after a timeout or Ctrl-C); without, it is marked ``failed``
    with :func:`orphan_reason`. Waits up to ``wait`` s for the owner to let
    go; while it holds the folder nothing is changed. Runs written without
    owner info (older versions) or by an owner on another machine are never
    marked (:func:`_may_take_over`). None if unreadable.
    """
    results = run_dir / RESULTS_FILE
    data = _read_json(results)
    if data is None or data.get("status") != "running" or "owner" not in data:
        return data
    if (fd := _take_lock(run_dir, data["owner"], wait)) is None:
        return data
    try:
        data = _read_json(results)  # the owner may have finished meanwhile
        if data is not None and data.get("status") == "running":
            _mark(run_dir, data, status or "failed", reason or orphan_reason(data))
        return data
    finally:
        os.close(fd)


def record_failure(
    run_dir: Path, run_id: int, error: str, wait: float = 0.0, **fields: Any
) -> dict[str, Any] | None:
    """Mark run ``run_id`` ``failed`` with ``error``, Flower's account of why.

    For the CLI once Flower reports the run failed: ``error`` (the last line
    of the traceback in Flower's log) replaces the ``error`` its ServerApp
    wrote on failing, and a run left ``running`` is marked ``failed`` as
    :func:`settle` does once its owner has let go (waiting up to ``wait``
    s). ``fields`` are added (e.g. ``flower_log``). A results.json of another
    run, or one that says ``completed`` or ``stopped``, is left as it is.
    Returns the results (None if unreadable).
    """
    results = run_dir / RESULTS_FILE
    data = _read_json(results)
    if data is None or data.get("run_id") != run_id:
        return data
    status = data.get("status")
    if status == "running" and "owner" in data:
        owner: Mapping[str, Any] | None = data["owner"]
    elif status == "failed":
        owner = None  # ended by its ServerApp: only a new claim may hold the lock
    else:
        return data
    if (fd := _take_lock(run_dir, owner, wait)) is None:
        return data
    try:
        data = _read_json(results)  # re-read under the lock
        if (
            data is not None
            and data.get("run_id") == run_id
            and data.get("status") in ("running", "failed")
        ):
            data.update(fields)
            _mark(run_dir, data, "failed", error)
        return data
    finally:
        os.close(fd)
