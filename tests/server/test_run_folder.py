"""Issue #26 part 2: a run owns its folder, and every rewrite is atomic.

Oracles: what a reader of the files sees while several writers rewrite them
(never a partial or empty file, no failed write), and what a second run into
the same folder gets (a one-line error naming the folder) while the first
lives in another process.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fedadapt.server import run_folder
from fedadapt.server.checkpoint import save_checkpoint
from fedadapt.server.results import RunRecorder, claim_run_folder
from fedadapt.server.run_folder import (
    LOCK_FILE,
    RunFolder,
    RunFolderError,
    owner_alive,
    settle,
)


@pytest.fixture(autouse=True)
def _quick_claims(monkeypatch):
    """A busy folder is reported after 0.1 s instead of 2 s."""
    monkeypatch.setattr(run_folder, "CLAIM_RETRY_S", 0.1)


def _hammer(write, read, writers: int = 4, writes: int = 60, readers: int = 2):
    """Run ``writers`` threads of ``write(i, n)`` and ``readers`` of ``read()``.

    Returns (write errors, bad reads, good reads).
    """
    errors: list[BaseException] = []
    bad: list[str] = []
    good = [0]
    done = threading.Event()

    def writer(i: int) -> None:
        for n in range(writes):
            try:
                write(i, n)
            except BaseException as error:  # noqa: BLE001 - counted, asserted on
                errors.append(error)

    def reader() -> None:
        while not done.is_set():
            outcome = read()
            if outcome is None:
                good[0] += 1
            elif outcome != "absent":
                bad.append(outcome)

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for thread in threads:
        thread.start()
    workers = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    for thread in threads:
        thread.join()
    return errors, bad, good[0]


def test_concurrent_results_writers_never_fail_and_readers_never_see_a_part(
    tmp_path, cfg
):
    config = cfg(output_dir=str(tmp_path), run_name="shared")
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    recorders = [RunRecorder(run_dir, config, run_id=i) for i in range(4)]
    payload = "x" * 200_000  # a long run's results.json: many write() calls

    def write(i: int, n: int) -> None:
        recorders[i].data["rounds"] = [{"round": n, "pad": payload}]
        recorders[i].write()

    def read() -> str | None:
        try:
            text = (run_dir / "results.json").read_text()
        except FileNotFoundError:
            return "absent"
        try:
            data = json.loads(text)
        except ValueError:
            return f"partial read of {len(text)} characters"
        return None if data["run_id"] in range(4) else "foreign"

    errors, bad, good = _hammer(write, read)
    assert errors == [] and bad == [], (errors[:3], bad[:3])
    assert good > 0
    assert [p.name for p in run_dir.iterdir()] == ["results.json"]  # no temp left


def test_concurrent_checkpoint_writers_never_fail_and_readers_load_whole_files(
    tmp_path,
):
    path = tmp_path / "checkpoint.pkl"
    arrays = {"w": np.arange(300_000, dtype=np.float32)}

    def write(i: int, n: int) -> None:
        save_checkpoint(path, n, arrays, {"writer": i}, {"config": {}})

    def read() -> str | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "absent"
        try:
            payload = pickle.loads(data)  # noqa: S301 - written by this test
        except Exception:  # noqa: BLE001 - any unpickling error is a partial read
            return f"partial read of {len(data)} bytes"
        return None if len(payload["arrays"]["w"]) == 300_000 else "short"

    errors, bad, good = _hammer(write, read, writes=20)
    assert errors == [] and bad == [], (errors[:3], bad[:3])
    assert good > 0
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pkl"]


_HOLDER = """
import sys, time
from pathlib import Path
from fedadapt.config import validate_run_config
from fedadapt.server.results import RunRecorder, claim_run_folder
cfg = validate_run_config({"output-dir": sys.argv[1], "run-name": "live"})
folder = claim_run_folder(cfg, 1)
recorder = RunRecorder(folder.path, cfg, 1, folder=folder)
print("claimed", flush=True)
time.sleep(600)
"""


@pytest.fixture
def live_owner(tmp_path):
    """A process that claimed <tmp>/live and writes results.json (status running)."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "claimed"
        yield process
    finally:
        process.kill()
        process.wait()


def test_second_run_into_a_live_folder_fails_at_start_naming_it(
    tmp_path, cfg, live_owner
):
    from fedadapt.server import server_app

    run_dir = tmp_path / "live"
    before = (run_dir / "results.json").read_bytes()
    config = {"output-dir": str(tmp_path), "run-name": "live"}
    with pytest.raises(RunFolderError) as info:
        claim_run_folder(cfg(**{k.replace("-", "_"): v for k, v in config.items()}), 2)
    message = str(info.value)
    assert f"run folder {run_dir} is in use by a live run" in message
    assert f"pid {live_owner.pid}" in message and "\n" not in message
    # the ServerApp fails the same way before it contacts any node; overwrite
    # does not take a live folder either
    from flwr.app import Context, RecordDict

    for extra in ({}, {"overwrite": True}):
        context = Context(2, 0, {}, RecordDict(), {**config, **extra})
        with pytest.raises(RunFolderError, match="in use by a live run"):
            server_app.main(None, context)  # type: ignore[arg-type]
    assert (run_dir / "results.json").read_bytes() == before  # untouched
    data = json.loads(before)
    assert data["status"] == "running" and data["owner"]["pid"] == live_owner.pid
    assert owner_alive(data["owner"]) is True
    assert settle(run_dir)["status"] == "running"  # a live run is left alone


def test_kill_9_of_the_owner_is_seen_by_the_next_reader(tmp_path, live_owner):
    run_dir = tmp_path / "live"
    live_owner.send_signal(signal.SIGKILL)
    live_owner.wait()
    data = json.loads((run_dir / "results.json").read_text())
    assert data["status"] == "running"  # what the killed process left behind
    assert owner_alive(data["owner"]) is False
    settled = settle(run_dir)
    assert settled is not None and settled["status"] == "failed"
    assert f"pid {live_owner.pid}" in settled["error"]
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["error"] == settled["error"]


def test_a_finished_run_is_never_overwritten_without_overwrite(tmp_path, cfg):
    config = cfg(output_dir=str(tmp_path), run_name="done")
    folder = claim_run_folder(config, 1)
    recorder = RunRecorder(folder.path, config, 1, folder=folder)
    recorder.record_round(1, 1, {"loss": 1.0}, {})
    save_checkpoint(folder.path / "checkpoint.pkl", 1, {}, None, recorder.data)
    recorder.finish("completed")
    assert not folder.held
    results = tmp_path / "done" / "results.json"
    first = results.read_bytes()
    for status in ("completed", "failed", "stopped"):
        data = json.loads(first)
        data["status"] = status
        results.write_text(json.dumps(data))
        with pytest.raises(RunFolderError) as info:
            claim_run_folder(config, 2)
        assert str(info.value) == (
            f"run folder {tmp_path / 'done'} already holds run 1 (status {status}); "
            "set another run-name, or overwrite=true to replace it"
        )
    # a run resuming from a checkpoint in that folder may take it over
    resumed = claim_run_folder(
        cfg(output_dir=str(tmp_path), run_name="done",
            resume_from=str(tmp_path / "done" / "checkpoint.pkl")), 2,
    )  # fmt: skip
    assert resumed.held and results.exists()
    resumed.release()
    # overwrite=true replaces it: the old run's files are gone
    replaced = claim_run_folder(
        cfg(output_dir=str(tmp_path), run_name="done", overwrite=True), 3
    )
    assert sorted(p.name for p in replaced.path.iterdir()) == [LOCK_FILE]
    replaced.release()


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path, cfg):
    folder = claim_run_folder(cfg(output_dir=str(tmp_path), run_name="early"), 1)
    assert (tmp_path / "early" / LOCK_FILE).exists()
    folder.release()
    assert not (tmp_path / "early").exists()
    again = RunFolder.claim(tmp_path / "early")  # and the name is free again
    again.release()


def test_a_lock_file_replaced_meanwhile_is_not_trusted(tmp_path):
    # the holder released and removed an empty folder while a claimer had the
    # old lock file open: the claimer must not own the new folder's lock
    first = RunFolder.claim(tmp_path / "r")
    stale = os.open(tmp_path / "r" / LOCK_FILE, os.O_RDWR)
    first.release()  # removes .lock and the folder
    second = RunFolder.claim(tmp_path / "r")
    import fcntl

    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the old inode: free
    with pytest.raises(RunFolderError):
        RunFolder.claim(tmp_path / "r")  # the new inode is still held
    os.close(stale)
    second.release()


def test_owner_info_identifies_this_process(tmp_path):
    folder = RunFolder.claim(tmp_path / "me")
    assert folder.owner["pid"] == os.getpid()
    assert owner_alive(folder.owner) is True
    other = dict(folder.owner, start_ticks=folder.owner["start_ticks"] - 1)
    assert owner_alive(other) is False  # a reused pid is not the owner
    assert owner_alive(dict(folder.owner, host="elsewhere")) is None
    lock = json.loads(Path(tmp_path / "me" / LOCK_FILE).read_text())
    assert lock == folder.owner
    folder.release()


def test_an_owner_on_another_machine_is_never_declared_dead(tmp_path, cfg):
    # a run folder on a shared (network / VM) file system: the remote owner's
    # lock may not show here, so a free lock proves nothing; an owner in a
    # container on this kernel (same boot id) holds a lock we do see
    config = cfg(output_dir=str(tmp_path), run_name="far")
    folder = claim_run_folder(config, 1)
    RunRecorder(folder.path, config, 1, folder=folder)
    folder.release()  # the lock is free, results.json says running
    results = tmp_path / "far" / "results.json"
    data = json.loads(results.read_text())
    here = data["owner"]
    data["owner"] = dict(here, host="elsewhere", boot_id="another-machine")
    results.write_text(json.dumps(data))
    assert settle(tmp_path / "far")["status"] == "running"
    data["owner"] = dict(here, host="a-container", pid=1)  # same kernel
    results.write_text(json.dumps(data))
    settled = settle(tmp_path / "far")
    assert settled["status"] == "failed" and "pid 1 on a-container" in settled["error"]


@pytest.mark.parametrize(
    "error, status, words",
    [
        (KeyboardInterrupt(), "stopped", "SIGINT"),
        (SystemExit(143), "stopped", "exit code 143"),
        (ValueError("bad"), "failed", "ValueError('bad')"),
    ],
)
def test_a_signal_ends_the_run_stopped_not_failed(error, status, words):
    """#42: a deployment stopped by SIGTERM/Ctrl-C said ``failed`` with
    ``KeyboardInterrupt()``; a signal is a stop, named, an exception a failure."""
    from fedadapt.server.run import ended_by

    got_status, reason = ended_by(error)
    assert got_status == status and words in reason
