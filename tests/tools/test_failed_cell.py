"""A failed cell shows Flower's real error (issue #39).

Flower reports a run whose simulation runtime failed as "Simulation failed
with exception: An error was encountered. Ending simulation."; the real
error is only in the run's log, which the SuperLink keeps while it runs.
``fedadapt-exp run`` fetches that log before it stops the SuperLink, prints
the real error on the cell's FAILED line, saves the log as the cell's
``flower.log``, and ends the cell's results.json ``failed`` with that error
(no lock left held); ``fedadapt-exp report`` lists such cells as failed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedadapt.tools.experiments import load_suite, main, write_report
from fedadapt.tools.flower_log import real_error
from tests.helpers import ROOT, VENV_BIN, FakeSuperLink, fake_ray

#: the real error of a simulation whose Ray cluster did not start
RAY_ERROR = (
    "Exception: The current node timed out during startup. This could happen "
    "because some of the raylet failed to startup or the GCS has become overloaded."
)
#: what Flower 1.42 logs then (shortened): the cause, then its own wrapper
RAY_LOG = f"""\
\x1b[92mINFO \x1b[0m:      Starting Flower Simulation
\x1b[91mERROR \x1b[0m:     An exception occurred !! The current node timed out
\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):
  File "flwr/simulation/run_simulation.py", line 330, in _main_loop
    vce.start_vce(
  File "ray/_private/worker.py", line 1800, in init
    _global_node = ray._private.node.Node(
{RAY_ERROR}

\x1b[91mERROR \x1b[0m:     Simulation raised an exception
Traceback (most recent call last):
  File "flwr/simulation/run_simulation.py", line 330, in _main_loop
    vce.start_vce(
{RAY_ERROR}

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "flwr/simulation/app.py", line 337, in run_simulation_process
    simulation_result = _run_simulation(
                        ^^^^^^^^^^^^^^^^
RuntimeError: An error was encountered. Ending simulation.
\x1b[91mERROR \x1b[0m:     Exit Code: 700

An unhandled exception occurred when running the simulation.
"""

SUITE = """
name: broken
description: one cell that fails
num-supernodes: 2
rounds: 1
seeds: [0]
metric: eval-loss
base: {task: digits-mlp, clients-per-round: 2}
methods:
  sgd: {client-optimizer: sgd}
"""


def _lock_is_free(run_dir: Path) -> bool:
    """Whether nobody holds the run folder's lock (a new run could claim it)."""
    lock = run_dir / ".lock"
    if not lock.exists():
        return True
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# --- the real error in Flower's log ------------------------------------------


def test_the_cause_not_flowers_wrapper_is_the_real_error():
    assert real_error(RAY_LOG) == RAY_ERROR


def test_a_serverapp_traceback_gives_its_last_line():
    log = (
        "\x1b[91mERROR \x1b[0m:     Simulation raised an exception\n"
        "Traceback (most recent call last):\n"
        '  File "fedadapt/server/server_app.py", line 225, in _run\n'
        "    save_final_model(recorder.run_dir, _numpy(result.arrays))\n"
        "IsADirectoryError: [Errno 21] Is a directory: 'a' -> 'b'\n"
        "\x1b[91mERROR \x1b[0m:     Exit Code: 700\n"
    )
    assert real_error(log) == "IsADirectoryError: [Errno 21] Is a directory: 'a' -> 'b'"


def test_a_later_one_line_fedadapt_error_wins_and_boilerplate_is_skipped():
    client = (
        "(ClientAppActor pid=7) Traceback (most recent call last):\n"
        '(ClientAppActor pid=7)   File "client.py", line 1, in train\n'
        "(ClientAppActor pid=7) ValueError: bad batch\n"
    )
    summary = "ERROR :     fedadapt: run failed: round 1: no usable train reply\n"
    assert real_error(client + summary) == (
        "fedadapt: run failed: round 1: no usable train reply"
    )
    assert real_error(client) == "ValueError: bad batch"
    assert real_error("ERROR :     Exit Code: 700\nERROR :     disk full\n") == (
        "disk full"
    )
    assert real_error("INFO :      all good\n") == ""


# --- a suite whose cell fails (Flower replaced) --------------------------------

#: claims a run folder as a ServerApp does and stays alive holding its lock,
#: as a ServerApp left hanging by a simulation runtime that failed
_HOLDER = """
import json, sys, time
from pathlib import Path
from fedadapt._atomic import atomic_write_text
from fedadapt.server.run_folder import RunFolder
folder = RunFolder.claim(Path(sys.argv[1]), overwrite=True)
data = {"run_id": int(sys.argv[2]), "status": "running", "owner": folder.owner,
        "rounds": []}
atomic_write_text(folder.path / "results.json", json.dumps(data))
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_failed_cell_shows_the_real_error_and_ends_failed_unlocked(
    tmp_path, monkeypatch, capsys
):
    """Flower says only "An error was encountered"; the ServerApp still holds
    its folder (results.json ``running``) when Flower reports the run failed.
    The FAILED line names the real error from Flower's log, the log is saved
    as flower.log, and once the suite has stopped everything results.json
    says ``failed`` with that error and its lock is free; the report lists
    the cell as failed with it."""
    from fedadapt.tools import submission

    holders: list[subprocess.Popen] = []

    class SuperLink(FakeSuperLink):
        def __exit__(self, *exc: object) -> None:
            for holder in holders:  # stopping the SuperLink ends its ServerApps
                holder.kill()
                holder.wait()

    def fake_flwr(args, env, **kw):
        if args[0] == "run":
            config = args[args.index("--run-config") + 1]
            out = re.search(r'output-dir="([^"]+)"', config).group(1)
            name = re.search(r'run-name="([^"]+)"', config).group(1)
            holder = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, str(Path(out) / name), "41"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            holders.append(holder)
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "claimed"
            return json.dumps({"run-id": 41})
        if args[0] == "log":
            assert args[1:] == ["41", "fake", "--show"]
            return RAY_LOG
        raise AssertionError(args)

    fake_ray(monkeypatch)
    monkeypatch.setattr(submission, "SimulationSuperLink", SuperLink)
    monkeypatch.setattr(submission, "flwr", fake_flwr)
    monkeypatch.setattr(submission, "FAILED_SETTLE_WAIT_S", 0.2)
    # the holder wrote results.json once: Flower is asked once it is quiet
    monkeypatch.setattr(submission, "RESULTS_QUIET_S", 0.5)
    monkeypatch.setattr(submission, "FIRST_STATUS_POLL_S", 0.05)
    monkeypatch.setattr(
        submission,
        "run_status",
        lambda *a: {
            "status": "finished:failed",
            "status-details": "Simulation failed with exception: An error was "
            "encountered. Ending simulation.",
        },
    )
    path = tmp_path / "suite.yaml"
    path.write_text(SUITE)
    out = tmp_path / "out"
    try:
        assert main(["run", str(path), "--output", str(out)]) == 1
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    run_dir = out / "broken" / load_suite(path).cells(out)[0].run_name
    console = capsys.readouterr().out
    assert f"FAILED {run_dir.name}: finished:failed: {RAY_ERROR}" in console
    assert f"Flower's log: {run_dir / 'flower.log'}" in console
    assert (run_dir / "flower.log").read_text() == RAY_LOG
    data = json.loads((run_dir / "results.json").read_text())
    assert data["status"] == "failed" and data["error"] == RAY_ERROR
    assert _lock_is_free(run_dir)

    assert main(["report", str(path), "--output", str(out)]) == 0
    report = (out / "broken" / "report.md").read_text()
    assert "| sgd | — | failed | 0 (1 failed) |" in report
    assert f"| {run_dir.name} | failed | {RAY_ERROR} |" in report


# --- the report ---------------------------------------------------------------

REPORT_SUITE = """
name: mixed
description: cells that ended every way
num-supernodes: 3
rounds: 2
seeds: [0, 1]
metric: eval-loss
base: {task: digits-mlp}
methods:
  sgd: {client-optimizer: sgd}
  adam: {client-optimizer: adam}
"""


def _results(folder: Path, status: str, rounds: int, **extra: object) -> None:
    folder.mkdir(parents=True)
    data = {
        "run_id": 1,
        "status": status,
        "rounds": [
            {"round": r + 1, "eval": {"loss": 1.0 / (r + 1)}} for r in range(rounds)
        ],
        **extra,
    }
    (folder / "results.json").write_text(json.dumps(data))


def test_the_report_lists_failed_missing_and_unfinished_cells(tmp_path):
    """results.json written by hand: sgd seed 0 completed, seed 1 failed; adam
    seed 0 left running, seed 1 never ran (only Flower's log saved)."""
    path = tmp_path / "suite.yaml"
    path.write_text(REPORT_SUITE)
    suite = load_suite(path)
    out = tmp_path / "out"
    cells = {
        (c.method, c.seed): out / "mixed" / c.run_name
        for c in suite.cells(out / "mixed")
    }
    _results(cells["sgd", 0], "completed", 2)
    _results(cells["sgd", 1], "failed", 1, error="RuntimeError: boom | bang")
    _results(cells["adam", 0], "running", 1)
    cells["adam", 1].mkdir(parents=True)
    (cells["adam", 1] / "flower.log").write_text(RAY_LOG)

    summary = write_report(suite, out)
    assert list(summary["methods"]) == ["sgd"]  # numbers only from completed cells
    failed = {(f["method"], f["seed"]): f for f in summary["failed_cells"]}
    assert set(failed) == {("sgd", 1), ("adam", 0), ("adam", 1)}
    assert failed["sgd", 1]["status"] == "failed"
    assert failed["sgd", 1]["error"] == "RuntimeError: boom | bang"
    assert failed["adam", 0]["status"] == "unfinished"
    assert failed["adam", 1]["status"] == "missing"
    assert failed["adam", 1]["error"] == RAY_ERROR  # from its flower.log
    on_disk = json.loads((out / "mixed" / "report.json").read_text())
    assert on_disk["failed_cells"] == summary["failed_cells"]

    report = (out / "mixed" / "report.md").read_text()
    assert "| sgd | default | 0.5 | 1 (1 failed) |" in report
    assert "| adam | — | failed | 0 (2 failed) |" in report
    assert "## Failed cells" in report and "3 of 4 cells did not complete" in report
    assert (
        f"| {cells['sgd', 1].name} | failed | RuntimeError: boom \\| bang |" in report
    )
    assert f"| {cells['adam', 0].name} | failed (unfinished) |" in report
    assert f"| {cells['adam', 1].name} | failed (missing) | {RAY_ERROR} |" in report


# --- through Flower -------------------------------------------------------------


@pytest.mark.e2e  # one `flwr run` of one round, ~40-70 s
@pytest.mark.deploy  # beside the default suite in CI, to keep its time
def test_a_cell_that_fails_in_the_serverapp_shows_its_traceback(tmp_path):
    """A real ServerApp exception after results.json exists: the cell's
    folder holds a directory where the final model goes, so writing it
    raises IsADirectoryError once the round is done. Flower's status says
    only the message; the console and results.json get the traceback's last
    line (with the type), flower.log the whole log, and no lock is held."""
    path = tmp_path / "suite.yaml"
    path.write_text(SUITE)
    out = tmp_path / "out"
    run_dir = out / "broken" / load_suite(path).cells(out)[0].run_name
    (run_dir / "final_model.npz").mkdir(parents=True)
    done = subprocess.run(
        [str(VENV_BIN / "fedadapt-exp"), "run", str(path), "--output", str(out),
         "--app", str(ROOT)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    console = done.stdout + done.stderr
    assert done.returncode == 1, console[-3000:]
    error = re.search(r"FAILED \S+: finished:failed: (IsADirectoryError: .*)", console)
    assert error, console[-3000:]
    assert "final_model.npz" in error.group(1)
    data = json.loads((run_dir / "results.json").read_text())
    assert data["status"] == "failed" and data["error"] == error.group(1)
    assert data["flower_log"] == "flower.log"
    assert "Traceback (most recent call last)" in (run_dir / "flower.log").read_text()
    assert _lock_is_free(run_dir)
