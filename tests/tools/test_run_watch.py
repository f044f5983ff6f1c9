"""submit_run waits for a run's real outcome without flooding the machine with
``flwr ls`` processes: it follows the run's results.json, does not ask
Flower while the ServerApp writes it, asks when it goes quiet, and promptly
once the ServerApp is done."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from fedadapt.tools import submission as cli
from tests.helpers import FakeSuperLink


def _write(path: Path, status: str, rounds: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "run_id": 7,
        "status": status,
        "rounds": [{"round": r + 1, "replies": {"used": 2}} for r in range(rounds)],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _submit(tmp_path: Path, out: Path) -> cli.RunOutcome:
    """submit_run of a 2-round run whose results go to ``out``, Flower faked."""
    return cli.submit_run(
        FakeSuperLink(tmp_path / "home"),
        tmp_path,
        {"output-dir": str(out), "num-server-rounds": 2},
        2,
        timeout=30,
    )


def test_follows_results_json_and_asks_flower_only_when_it_matters(
    tmp_path, monkeypatch
):
    out = tmp_path / "out"
    results = out / "run-7" / "results.json"
    # a stale results.json of another run in the same folder is never taken
    _write(out / "old" / "results.json", "completed", 2)
    json_old = json.loads((out / "old" / "results.json").read_text())
    json_old["run_id"] = 3
    (out / "old" / "results.json").write_text(json.dumps(json_old))

    finished = threading.Event()
    asked: list[float] = []
    writes: list[float] = []  # when the ServerApp wrote: first and "completed"

    def fake_flwr(args, env, **kw):
        assert args[0] == "run"
        return json.dumps({"run-id": 7})

    def fake_status(run_id, env, conn):
        asked.append(time.monotonic())
        done = finished.is_set()
        return {"status": "finished:completed" if done else "running"}

    def server_app():
        time.sleep(4.5)  # Flower starting the ServerApp: no results.json yet
        _write(results, "running", 0)
        writes.append(time.monotonic())
        time.sleep(3.0)
        _write(results, "running", 1)
        time.sleep(3.0)
        writes.append(time.monotonic())
        _write(results, "completed", 2)
        time.sleep(0.3)  # Flower marks the run finished a moment later
        finished.set()

    monkeypatch.setattr(cli, "flwr", fake_flwr)
    monkeypatch.setattr(cli, "run_status", fake_status)
    monkeypatch.setattr(cli, "FIRST_STATUS_POLL_S", 2.0)
    monkeypatch.setattr(cli, "STATUS_POLL_S", 60.0)
    monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.05)
    threading.Thread(target=server_app, daemon=True).start()
    started = time.monotonic()
    outcome = _submit(tmp_path, out)
    assert outcome.ok and outcome.results == results, outcome
    took = time.monotonic() - started
    # a run of ~10.8 s: asked at 2 and 4 s (FIRST_STATUS_POLL_S, then a
    # quarter of the time elapsed, at least that), while there is no results.json;
    # never while the ServerApp writes it (#39: each ask is a Python process);
    # then about a second after "completed", not 60 s (STATUS_POLL_S) late.
    # Bounds relative to how long it really took (a loaded machine)
    before = [t for t in asked if t < writes[0]]
    during = [t for t in asked if writes[0] <= t < writes[1]]
    after = [t for t in asked if t >= writes[1]]
    assert 1 <= len(before) <= 3 and not during, (asked, writes)
    assert asked[0] - started >= 1.9, (asked, started)  # not at once
    assert 1 <= len(after) <= 3 and after[-1] - writes[1] < 5.0, (asked, writes)
    assert took < 10.8 + 10.0


def test_flower_is_asked_once_the_serverapps_process_has_exited(tmp_path, monkeypatch):
    """#39: after results.json says completed, Flower reports the run
    finished only once the ServerApp's process has exited (a simulation's
    shuts down for 2–4 s more). While that process, named in results.json's
    ``owner``, still runs here, Flower is not asked (each ask is a Python
    process, on the CPUs the next cell is starting on); right after it
    exits, Flower is asked, once."""
    import subprocess
    import sys

    from fedadapt.client.process_info import process_start_ticks
    from fedadapt.server import run_folder

    out = tmp_path / "out"
    results = out / "run-7" / "results.json"
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.0)"])
    asked: list[float] = []
    try:
        owner = {
            **run_folder.owner_info(),
            "pid": exiting.pid,
            "start_ticks": process_start_ticks(exiting.pid),
        }
        _write(results, "completed", 2)
        data = json.loads(results.read_text())
        results.write_text(json.dumps({**data, "owner": owner}))

        def fake_status(run_id, env, conn):
            asked.append(time.monotonic())
            gone = exiting.poll() is not None
            return {"status": "finished:completed" if gone else "running"}

        monkeypatch.setattr(cli, "flwr", lambda args, env, **kw: '{"run-id": 7}')
        monkeypatch.setattr(cli, "run_status", fake_status)
        monkeypatch.setattr(cli, "FIRST_STATUS_POLL_S", 0.05)
        monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.05)
        outcome = _submit(tmp_path, out)
        exited = time.monotonic()  # no later than this
    finally:
        exiting.kill()
        exiting.wait()
    assert outcome.ok, outcome
    assert len(asked) == 1, asked
    assert asked[0] <= exited


def test_a_serverapp_process_that_outlives_its_run_delays_the_ask_boundedly(
    tmp_path, monkeypatch
):
    """A process named ``owner`` that goes on running after its run ended
    (this test's own): Flower is asked once OWNER_EXIT_WAIT_S has passed,
    not never."""
    from fedadapt.server import run_folder

    out = tmp_path / "out"
    results = out / "run-7" / "results.json"
    _write(results, "completed", 2)
    data = json.loads(results.read_text())
    results.write_text(json.dumps({**data, "owner": run_folder.owner_info()}))
    asked: list[float] = []

    def fake_status(run_id, env, conn):
        asked.append(time.monotonic())
        return {"status": "finished:completed"}

    monkeypatch.setattr(cli, "flwr", lambda args, env, **kw: '{"run-id": 7}')
    monkeypatch.setattr(cli, "run_status", fake_status)
    monkeypatch.setattr(cli, "FIRST_STATUS_POLL_S", 0.05)
    monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.05)
    monkeypatch.setattr(cli, "OWNER_EXIT_WAIT_S", 0.6)
    started = time.monotonic()
    outcome = _submit(tmp_path, out)
    assert outcome.ok, outcome
    assert len(asked) == 1 and asked[0] - started >= 0.6, (asked, started)


def test_a_run_whose_results_go_quiet_is_asked_about_again(tmp_path, monkeypatch):
    """A ServerApp that wrote results.json ``running`` and then nothing (stuck
    at start-up, or its Ray clients gone): once the file has been quiet for
    RESULTS_QUIET_S, Flower's status is asked again, and its failure ends the
    wait with the run failed."""
    out = tmp_path / "out"
    _write(out / "run-7" / "results.json", "running", 0)
    asked: list[float] = []

    def fake_status(run_id, env, conn):
        asked.append(time.monotonic())
        return {"status": "finished:failed" if len(asked) >= 2 else "running"}

    monkeypatch.setattr(cli, "flwr", lambda args, env, **kw: '{"run-id": 7}')
    monkeypatch.setattr(cli, "run_status", fake_status)
    monkeypatch.setattr(cli, "fetch_failure_log", lambda *a: ("", None))
    monkeypatch.setattr(cli, "FIRST_STATUS_POLL_S", 0.1)
    monkeypatch.setattr(cli, "STATUS_POLL_S", 0.2)
    monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.05)
    monkeypatch.setattr(cli, "RESULTS_QUIET_S", 1.0)
    started = time.monotonic()
    outcome = _submit(tmp_path, out)
    assert outcome.status == "finished:failed" and not outcome.ok
    assert len(asked) == 2
    # the file was written just before: the first ask waits for the quiet
    assert asked[0] - started >= 0.8, (asked, started)


def test_a_run_that_never_writes_results_is_still_detected(tmp_path, monkeypatch):
    """A ServerApp that fails before writing results.json: Flower's status,
    asked every STATUS_POLL_S, ends the wait; the outcome names the failure."""
    calls = []

    def fake_status(run_id, env, conn):
        calls.append(1)
        return {"status": "finished:failed" if len(calls) >= 3 else "starting"}

    monkeypatch.setattr(cli, "flwr", lambda args, env, **kw: '{"run-id": 9}')
    monkeypatch.setattr(cli, "run_status", fake_status)
    monkeypatch.setattr(cli, "FIRST_STATUS_POLL_S", 0.1)
    monkeypatch.setattr(cli, "STATUS_POLL_S", 0.2)
    monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.05)
    outcome = _submit(tmp_path, tmp_path / "out")
    assert outcome.status == "finished:failed" and not outcome.ok
    assert outcome.results is None and len(calls) == 3


def test_a_superlink_that_died_is_a_failed_run_not_a_crash(monkeypatch):
    """Issue #26: ``flwr ls`` against a dead SuperLink answers without "runs"
    (or fails): run_status reports the run failed and says why."""
    answers = [
        '{"success": false, "error-message": "Connection refused"}',
        RuntimeError("flwr ls failed (1): Connection to the SuperLink is unavailable"),
        '{"success": true, "runs": []}',
    ]

    def fake_flwr(args, env, **kw):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(cli, "flwr", fake_flwr)
    for why in ("Connection refused", "unavailable", '"runs": []'):
        status = cli.run_status(5, {}, "fake")
        assert status["status"] == "finished:failed"
        details = status["status-details"]
        assert details.startswith("the SuperLink (fake) did not report run 5")
        assert why in details, details


def _flower_finishes_with(monkeypatch, finished: threading.Event) -> None:
    """Fake Flower: run 7 is submitted, and finished once ``finished`` is set."""

    def fake_status(run_id, env, conn):
        return {"status": "finished:completed" if finished.is_set() else "running"}

    monkeypatch.setattr(cli, "flwr", lambda args, env, **kw: '{"run-id": 7}')
    monkeypatch.setattr(cli, "run_status", fake_status)


class _Waits(threading.Event):
    """A cancel event that is never set and records each pause asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[tuple[float, float]] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.pauses.append((time.monotonic(), timeout or 0.0))
        return super().wait(timeout)


def test_once_the_last_round_is_in_the_end_is_looked_for_often(tmp_path, monkeypatch):
    """#39: results.json is looked at every RESULTS_POLL_S while rounds go on
    (each look may read a file of megabytes), every END_POLL_S once it holds
    the last round: the final evaluation and plots take about a second, and
    a suite starts its next cell when results.json says the run ended."""
    out = tmp_path / "out"
    results = out / "run-7" / "results.json"
    writes: dict[str, float] = {}
    finished = threading.Event()

    def server_app():
        _write(results, "running", 0)
        time.sleep(1.5)
        _write(results, "running", 1)
        time.sleep(1.5)
        writes["last round"] = time.monotonic()
        _write(results, "running", 2)  # the last of num-server-rounds=2
        time.sleep(1.5)  # final evaluation, plots
        writes["completed"] = time.monotonic()
        _write(results, "completed", 2)
        time.sleep(0.3)
        finished.set()

    _flower_finishes_with(monkeypatch, finished)
    monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.5)
    monkeypatch.setattr(cli, "END_POLL_S", 0.1)
    waits = _Waits()
    threading.Thread(target=server_app, daemon=True).start()
    outcome = cli.submit_run(
        FakeSuperLink(tmp_path / "home"),
        tmp_path,
        {"output-dir": str(out), "num-server-rounds": 2},
        2,
        timeout=30,
        cancel=waits,
    )
    assert outcome.ok, outcome
    before = [p for t, p in waits.pauses if t < writes["last round"]]
    # the last round is seen at the next look, at most RESULTS_POLL_S later
    ending = [
        p
        for t, p in waits.pauses
        if writes["last round"] + 0.6 <= t < writes["completed"]
    ]
    assert before and set(before) == {0.5}, waits.pauses
    assert len(ending) >= 3 and set(ending) == {0.1}, waits.pauses


def test_a_results_json_whose_rounds_are_not_a_list_does_not_crash_the_watch(
    tmp_path, monkeypatch
):
    """A damaged results.json ("rounds": 5) is not the last round's sign; the
    watch goes on until the file is whole again and the run ends."""
    out = tmp_path / "out"
    results = out / "run-7" / "results.json"
    finished = threading.Event()

    def server_app():
        results.parent.mkdir(parents=True)
        results.write_text(json.dumps({"run_id": 7, "status": "running", "rounds": 5}))
        time.sleep(1.0)
        _write(results, "completed", 2)
        time.sleep(0.3)
        finished.set()

    _flower_finishes_with(monkeypatch, finished)
    monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.05)
    threading.Thread(target=server_app, daemon=True).start()
    outcome = _submit(tmp_path, out)
    assert outcome.ok and outcome.results == results, outcome
