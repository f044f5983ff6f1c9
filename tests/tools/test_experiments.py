"""Experiment suites: validation, grid expansion, resume, report and claims."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path

import pytest

from fedadapt.config import ConfigError, validate_run_config
from fedadapt.tools.experiments import (
    SuiteError,
    cell_done,
    load_suite,
    main,
    parse_settings,
    select,
    summarise,
    write_report,
)
from tests.helpers import ROOT, VENV_BIN, FakeSuperLink, fake_ray

SUITE = """
name: tiny
description: test suite
num-supernodes: 3
rounds: 2
seeds: [0, 1]
metric: eval-loss
base: {task: digits-mlp, clients-per-round: 3}
methods:
  sgd: {client-optimizer: sgd, client-lr: [0.05, 0.1]}
  adam: {client-optimizer: adam, client-lr: 0.01}
claims:
  - {method: adam, beats: [sgd]}
"""


def _write(tmp_path, text=SUITE):
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    return path


def test_grid_expands_over_axes_and_seeds(tmp_path):
    suite = load_suite(_write(tmp_path))
    cells = suite.cells(tmp_path / "out")
    assert len(cells) == (2 + 1) * 2
    names = {c.run_name for c in cells}
    assert len(names) == len(cells)
    sgd = [c for c in cells if c.method == "sgd" and c.seed == 1]
    assert sorted(c.overrides["client-lr"] for c in sgd) == [0.05, 0.1]
    assert all(c.overrides["num-server-rounds"] == 2 for c in cells)
    assert all(c.overrides["task"] == "digits-mlp" for c in cells)


def test_settings_override_every_cell_and_name_the_variant(tmp_path):
    """--set dirichlet-alpha=0.01 client-lr=0.2: a grid axis collapses too."""
    settings = parse_settings(["dirichlet-alpha=0.01", "client-lr=0.2"])
    assert settings == {"dirichlet-alpha": 0.01, "client-lr": 0.2}
    suite = load_suite(_write(tmp_path), settings)
    assert suite.name == "tiny__dirichlet-alpha-0.01__client-lr-0.2"
    cells = suite.cells(tmp_path / "out")
    assert len(cells) == (1 + 1) * 2
    assert {c.overrides["dirichlet-alpha"] for c in cells} == {0.01}
    assert {c.overrides["client-lr"] for c in cells} == {0.2}
    assert load_suite(_write(tmp_path)).name == "tiny"


@pytest.mark.parametrize(
    ("items", "error", "pattern"),
    [
        (["alpha=0.1"], SuiteError, r"'--set alpha': not a run-config key"),
        (["seed=3"], SuiteError, r"'--set seed'"),
        (["dirichlet-alpha"], SuiteError, r"expected key=value"),
        (["dirichlet-alpha=-1"], ConfigError, r"'dirichlet-alpha'"),
    ],
)
def test_bad_settings_fail_naming_the_key(tmp_path, items, error, pattern):
    with pytest.raises(error, match=pattern):
        load_suite(_write(tmp_path), parse_settings(items))


def test_validate_command_takes_settings(tmp_path, capsys):
    path = _write(tmp_path)
    assert main(["validate", str(path), "--set", "client-lr=0.3"]) == 0
    assert "tiny__client-lr-0.3: 4 cells, valid" in capsys.readouterr().out
    assert main(["validate", str(path), "--set", "lr=0.3"]) == 2


@pytest.mark.parametrize(
    ("edit", "error", "pattern"),
    [
        (("rounds: 2", "rounds: 2\nepochs: 3"), SuiteError, r"'epochs': unknown"),
        (
            ("client-lr: 0.01}", "client-lr: 0.01, lr-warmup: 3}"),
            ConfigError,
            r"'lr-warmup': unknown key",
        ),
        (("client-lr: 0.01}", "client-lr: -1.0}"), ConfigError, r"'client-lr'"),
        (("client-lr: 0.01}", "client-lr: 0.01, seed: 3}"), SuiteError, r"adam.seed"),
        (("metric: eval-loss", "metric: f1"), SuiteError, r"'metric'"),
        (("beats: [sgd]", "beats: [sgdm]"), SuiteError, r"'claims.beats'"),
        (("num-supernodes: 3", "num-supernodes: 2"), SuiteError, r"num-supernodes"),
    ],
)
def test_bad_suites_fail_before_running_naming_the_key(tmp_path, edit, error, pattern):
    with pytest.raises(error, match=pattern):
        load_suite(_write(tmp_path, SUITE.replace(*edit)))


def _fake_results(folder, losses, status="completed"):
    folder.mkdir(parents=True)
    rounds = [{"round": i + 1, "eval": {"loss": v}} for i, v in enumerate(losses)]
    (folder / "results.json").write_text(
        json.dumps({"status": status, "rounds": rounds})
    )


def test_report_mean_std_best_point_and_claims(tmp_path):
    suite = load_suite(_write(tmp_path))
    out = tmp_path / "out"
    finals = {
        ("sgd", 0.05): (0.9, 0.7),
        ("sgd", 0.1): (0.5, 0.3),
        ("adam", 0.01): (0.2, 0.4),
    }
    for cell in suite.cells(out / "tiny"):
        lr = cell.overrides["client-lr"]
        final = finals[(cell.method, lr)][cell.seed]
        _fake_results(out / "tiny" / cell.run_name, [1.0, final])
    summary = write_report(suite, out)
    sgd = summary["methods"]["sgd"]
    assert sgd["best"] == "client-lr=0.1"
    assert sgd["points"]["client-lr=0.1"]["mean"] == pytest.approx(0.4)
    assert sgd["points"]["client-lr=0.1"]["std"] == pytest.approx(math.sqrt(0.02))
    adam = summary["methods"]["adam"]["points"]["default"]
    assert adam["mean"] == pytest.approx(0.3)
    assert summary["claims"][0]["status"] == "holds"  # 0.3 <= 0.4
    report = (out / "tiny" / "report.md").read_text()
    assert "| sgd | client-lr=0.1 | 0.4 ± 0.1414 | 2 |" in report
    assert (out / "tiny" / "report.png").stat().st_size > 3000


TARGET_SUITE = """
name: speed
description: rounds to a target
num-supernodes: 3
rounds: 4
seeds: [0, 1]
metric: eval-accuracy
base: {task: digits-mlp, clients-per-round: 3}
methods:
  fedavg: {strategy: fedavg}
  fast: {strategy: fedexp}
  never: {strategy: fedadam}
target: {metric: accuracy, value: 0.8}
baseline: fedavg
"""

#: per method and seed: eval accuracies of rounds 1..4 and one round's seconds
ACCURACIES = {
    ("fedavg", 0): ([0.5, 0.6, 0.7, 0.85], 1.0),  # reaches 0.8 at round 4, 4 s
    ("fedavg", 1): ([0.5, 0.8, 0.9, 0.9], 1.0),  # round 2, 2 s
    ("fast", 0): ([0.9, 0.9, 0.95, 0.95], 2.0),  # round 1, 2 s
    ("fast", 1): ([0.7, 0.81, 0.9, 0.9], 2.0),  # round 2, 4 s
    ("never", 0): ([0.1, 0.2, 0.3, 0.4], 1.0),
    ("never", 1): ([0.1, 0.2, 0.3, 0.79], 1.0),
}


def _fake_accuracy_runs(suite, out):
    for cell in suite.cells(out / suite.name):
        accs, seconds = ACCURACIES[(cell.method, cell.seed)]
        folder = out / suite.name / cell.run_name
        folder.mkdir(parents=True)
        rounds = [
            {"round": i + 1, "wall_time_s": seconds,
             "eval": {"accuracy": a, "loss": 1 - a}}
            for i, a in enumerate(accs)
        ]  # fmt: skip
        data = {"status": "completed", "initial": {"eval": {"accuracy": 0.1}}}
        (folder / "results.json").write_text(json.dumps({**data, "rounds": rounds}))


def _row(report, method):
    return next(
        [c.strip() for c in line.strip("|").split("|")]
        for line in report.splitlines()
        if line.startswith(f"| {method} |")
    )


def test_rounds_time_and_speedup_to_a_target(tmp_path):
    suite = load_suite(_write(tmp_path, TARGET_SUITE))
    out = tmp_path / "out"
    _fake_accuracy_runs(suite, out)
    summary = write_report(suite, out)
    fast = summary["methods"]["fast"]["target"]
    assert fast["rounds"] == [1, 2] and fast["seconds"] == [2.0, 4.0]
    # per seed: fedavg's rounds over fast's: 4/1, 2/2; seconds 4/2, 2/4
    assert fast["speedup_rounds"] == [4.0, 1.0]
    assert fast["speedup_seconds"] == [2.0, 0.5]
    assert summary["methods"]["never"]["target"]["rounds"] == [None, None]
    report = (out / "speed" / "report.md").read_text()
    assert "rounds to eval-accuracy ≥ 0.8" in report
    # rounds 1.5 ± 0.7071, seconds 3 ± 1.414, speed-ups 2.5 ± 2.121, 1.25 ± 1.061
    assert _row(report, "fast") == [
        "fast", "default", "0.925 ± 0.03536", "1.5 ± 0.7071", "3 ± 1.414",
        "2.5 ± 2.121×", "1.25 ± 1.061×", "2",
    ]  # fmt: skip
    assert _row(report, "fedavg")[3:7] == [
        "3 ± 1.414", "3 ± 1.414", "1 (baseline)", "1 (baseline)",
    ]  # fmt: skip
    never = _row(report, "never")
    assert never[3:7] == ["not reached"] * 4
    assert json.loads((out / "speed" / "report.json").read_text())["baseline"] == (
        "fedavg"
    )
    from matplotlib.image import imread

    height, width, _ = imread(out / "speed" / "report.png").shape
    assert width == 1100  # two panels of 5.5 in at 100 dpi: loss and accuracy


def test_one_seed_has_no_spread_and_a_partial_reach_says_how_many(tmp_path):
    suite = load_suite(_write(tmp_path, TARGET_SUITE))
    out = tmp_path / "out"
    _fake_accuracy_runs(suite, out)
    one = select(suite, seeds=[0])
    write_report(one, out)
    report = (out / "speed" / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert not any("±" in line for line in table), table
    assert _row(report, "fast")[3:7] == ["1", "2", "4×", "2×"]
    # target 0.79: "never" reaches it with seed 1 only
    main(["report", str(_write(tmp_path, TARGET_SUITE)), "--output", str(out),
          "--target", "accuracy=0.79"])  # fmt: skip
    report = (out / "speed" / "report.md").read_text()
    assert _row(report, "never")[3] == "4 (1/2 seeds)"
    assert _row(report, "never")[5] == "0.5× (1/2 seeds)"  # seed 1: 2 / 4 rounds


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--target", "accuracy"], "--target.*METRIC=VALUE"),
        (["--target", "f1=0.5"], "--target.metric"),
        (["--target", "accuracy=high"], "--target.value"),
        (["--baseline", "nope"], "--baseline.*unknown method 'nope'"),
    ],
)
def test_bad_target_or_baseline_fails_naming_the_flag(tmp_path, capsys, flags, pattern):
    assert main(["validate", str(_write(tmp_path, TARGET_SUITE)), *flags]) == 2
    assert re.search(pattern, capsys.readouterr().err)


def test_claim_that_fails_is_reported(tmp_path):
    suite = load_suite(
        _write(tmp_path, SUITE.replace("beats: [sgd]", "beats: [sgd], factor: 2.0"))
    )
    out = tmp_path / "out"
    for cell in suite.cells(out / "tiny"):
        _fake_results(out / "tiny" / cell.run_name, [1.0, 0.3])
    summary = summarise(suite, out)
    assert summary["claims"][0]["status"] == "fails"


def test_select_keeps_only_the_chosen_cells_under_their_own_names(tmp_path):
    """--methods / --seeds pick a subset whose cells are the full suite's
    cells (same names and overrides), so a later full run skips them."""
    suite = load_suite(_write(tmp_path))
    full = {c.run_name: c for c in suite.cells(tmp_path)}
    part = select(suite, methods=["sgd"], seeds=[1])
    cells = part.cells(tmp_path)
    assert sorted(c.run_name for c in cells) == [
        "sgd__client-lr-0.05__seed1",
        "sgd__client-lr-0.1__seed1",
    ]
    assert all(full[c.run_name] == c for c in cells)
    assert [c.seed for c in select(suite, seeds=[7]).cells(tmp_path)] == [7] * 3
    assert select(suite) == suite
    assert suite.seeds == [0, 1] and len(suite.methods) == 2  # not modified


def test_a_claim_on_an_unselected_method_is_missing_not_failed(tmp_path):
    suite = load_suite(_write(tmp_path))
    out = tmp_path / "out"
    for cell in suite.cells(out / "tiny"):
        _fake_results(out / "tiny" / cell.run_name, [1.0, 0.3])
    assert summarise(suite, out)["claims"][0]["status"] == "holds"
    part = select(suite, methods=["adam"])
    assert summarise(part, out)["claims"][0]["status"] == "missing"
    assert list(summarise(part, out)["methods"]) == ["adam"]


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--methods", "sgd,lamb"], "--methods.*'lamb'"),
        (["--methods", ","], "--methods.*at least one"),
        (["--seeds", ","], "--seeds.*at least one"),
        (["--seeds", "1,1"], "--seeds.*given twice"),
        (["--seeds", "0,-1"], "'seed'.*>= 0"),
    ],
)
def test_bad_selection_fails_naming_the_flag(tmp_path, capsys, flags, pattern):
    assert main(["validate", str(_write(tmp_path)), *flags]) == 2
    assert re.search(pattern, capsys.readouterr().err)


def test_seeds_must_be_integers(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["validate", str(_write(tmp_path)), "--seeds", "0,x"])
    assert stop.value.code == 2
    assert "expected integers" in capsys.readouterr().err


def test_validate_counts_the_selected_cells(tmp_path, capsys):
    args = ["validate", str(_write(tmp_path)), "--methods", "sgd", "--seeds", "0"]
    assert main(args) == 0
    assert "tiny: 2 cells, valid" in capsys.readouterr().out


def test_only_completed_cells_count_as_done(tmp_path):
    _fake_results(tmp_path / "a", [1.0, 0.5])
    _fake_results(tmp_path / "b", [1.0], status="completed")
    _fake_results(tmp_path / "c", [1.0, 0.5], status="failed")
    assert cell_done(tmp_path / "a" / "results.json", 2)
    assert not cell_done(tmp_path / "b" / "results.json", 2)
    assert not cell_done(tmp_path / "c" / "results.json", 2)
    assert not cell_done(tmp_path / "missing" / "results.json", 2)


def _flower_whose_runs_fail(monkeypatch, cpus=2, gpus=0, during_run=None):
    """Fake Flower and Ray (a machine of ``cpus`` and ``gpus``) for a suite:
    every ``flwr run`` is recorded in the list returned (filled as the suite
    runs; ``during_run()`` is called inside each) and its run ends failed.
    The fake cluster class is the list's ``cluster`` attribute."""
    import threading

    from fedadapt.tools import submission as cli

    class Commands(list):
        cluster = fake_ray(monkeypatch, cpus, gpus)

    commands, lock = Commands(), threading.Lock()

    def fake_flwr(args, env, **kw):
        if args[0] == "run":
            with lock:
                commands.append(list(args))
                run_id = len(commands)
            if during_run is not None:
                during_run()
            return json.dumps({"run-id": run_id})
        if args[0] == "log":  # a failed run's log is fetched: an empty one
            return ""
        raise AssertionError(args)

    monkeypatch.setattr(cli, "SimulationSuperLink", FakeSuperLink)
    monkeypatch.setattr(cli, "flwr", fake_flwr)
    monkeypatch.setattr(cli, "FIRST_STATUS_POLL_S", 0.05)  # a fake Flower: ask at once
    monkeypatch.setattr(
        cli,
        "run_status",
        lambda *a: {"status": "finished:failed", "status-details": ""},
    )
    return commands


def _results_as_made(folder, overrides, **edits):
    """A completed 2-round results.json whose ``config`` is what the ServerApp
    records for ``overrides`` (every default filled in), with ``edits`` (a
    value of None: the key absent, as in results made before it existed)."""
    config = json.loads(json.dumps(dict(validate_run_config(overrides)), default=str))
    for key, value in edits.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    folder.mkdir(parents=True)
    rounds = [{"round": i + 1, "eval": {"loss": 1.0 / (i + 1)}} for i in range(2)]
    data = {"status": "completed", "rounds": rounds, "config": config}
    (folder / "results.json").write_text(json.dumps(data))


def test_a_cell_made_with_another_config_is_stale_not_done(tmp_path):
    """Results made before a default changed (here: before the pull cap of
    #38 existed, or with another step size) are not taken for the cell now;
    where its results go, and how it was run, do not count."""
    suite = load_suite(_write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]")))
    out = tmp_path / "out" / "tiny"
    cells = {c.method + str(c.overrides.get("client-lr")): c for c in suite.cells(out)}
    current, before_cap, other_lr = cells["sgd0.05"], cells["sgd0.1"], cells["adam0.01"]
    _results_as_made(
        out / current.run_name,
        current.overrides,
        **{"output-dir": "/elsewhere", "overwrite": True, "round-timeout": 99.0},
    )
    _results_as_made(
        out / before_cap.run_name,
        before_cap.overrides,
        **{"max-contribution-ratio": None},
    )
    _results_as_made(out / other_lr.run_name, other_lr.overrides, **{"client-lr": 0.02})
    path = {c.run_name: out / c.run_name / "results.json" for c in cells.values()}
    assert cell_done(path[current.run_name], 2, current.overrides)
    assert not cell_done(path[before_cap.run_name], 2, before_cap.overrides)
    assert not cell_done(path[other_lr.run_name], 2, other_lr.overrides)
    assert cell_done(path[other_lr.run_name], 2)  # without the cell: status only
    summary = summarise(suite, tmp_path / "out")
    stale = {entry["cell"]: entry for entry in summary["failed_cells"]}
    assert set(stale) == {before_cap.run_name, other_lr.run_name}
    assert {entry["status"] for entry in stale.values()} == {"stale"}
    assert (
        "max-contribution-ratio: absent -> 2.0" in stale[before_cap.run_name]["error"]
    )
    assert "client-lr: 0.02 -> 0.01" in stale[other_lr.run_name]["error"]
    assert list(summary["methods"]) == ["sgd"]  # the current cell's numbers only


def test_an_apps_own_declared_defaults_are_what_the_cells_are_compared_with(
    tmp_path,
):
    """A user's app whose pyproject declares another default (a nested table,
    as TOML allows) ran each cell with it: not stale. A key this version of
    fedadapt does not know cannot be resolved: the results stand."""
    from fedadapt.tools.experiments import app_run_config, stale_reason

    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        "[tool.flwr.app.config]\ndirichlet-alpha = 0.3\n"
        '[tool.flwr.app.config.fedavg]\nweighting = "uniform"\n'
    )
    declared = app_run_config(app)
    assert declared == {"dirichlet-alpha": 0.3, "fedavg.weighting": "uniform"}
    suite = load_suite(_write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]")))
    cell = suite.cells(tmp_path / "out" / "tiny")[0]
    _results_as_made(
        tmp_path / "ran", {**declared, **cell.overrides}
    )  # what Flower gave the run
    data = json.loads((tmp_path / "ran" / "results.json").read_text())
    assert stale_reason(data, cell.overrides, declared) is None
    # compared with the library's defaults instead, both keys differ
    assert "dirichlet-alpha: 0.3 -> 0.5" in stale_reason(data, cell.overrides)
    assert stale_reason(data, cell.overrides, {**declared, "own-key": 1}) is None
    assert app_run_config(tmp_path / "nowhere") == {}


def test_a_suite_run_redoes_stale_cells_and_says_why(tmp_path, monkeypatch, capsys):

    suite = load_suite(_write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]")))
    out = tmp_path / "out" / "tiny"
    cells = suite.cells(out)
    for cell in cells[1:]:
        _results_as_made(out / cell.run_name, cell.overrides)
    _results_as_made(out / cells[0].run_name, cells[0].overrides, **{"seed": 7})
    commands = _flower_whose_runs_fail(monkeypatch)
    main(["run", str(_write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]"))),
          "--output", str(tmp_path / "out")])  # fmt: skip
    printed = capsys.readouterr().out
    submitted = [c[c.index("--run-config") + 1] for c in commands]
    assert len(submitted) == 1 and cells[0].run_name in submitted[0]
    assert (
        f"{cells[0].run_name}: redone, made with another config (seed: 7 -> 0)"
        in printed
    )
    assert "3 cells, 2 already done" in printed


@pytest.mark.e2e
@pytest.mark.deploy  # ~70 s; test_only_completed_cells_count_as_done: the skip
def test_run_through_flower_then_resume_skips_finished_cells(tmp_path):
    text = SUITE.replace("seeds: [0, 1]", "seeds: [0]").replace(
        "client-lr: [0.05, 0.1]", "client-lr: 0.1"
    )
    path = _write(tmp_path, text)
    command = [
        str(VENV_BIN / "fedadapt-exp"),
        "run",
        str(path),
        "--output",
        str(tmp_path / "out"),
        "--app",
        str(ROOT),
    ]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "2 cells, 0 already done" in first.stdout
    assert (tmp_path / "out" / "tiny" / "report.md").exists()
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0
    assert "2 cells, 2 already done" in again.stdout


SLOTS_SUITE = """\
name: slots
num-supernodes: 3
rounds: 3
seeds: [0]
metric: eval-loss
base: {task: synthetic-linreg, clients-per-round: 3, local-steps: 2}
methods:
  a: {strategy: fedavg}
  b: {strategy: fedexp}
  c: {strategy: feddua}
timeout: 400
"""


@pytest.mark.e2e
@pytest.mark.deploy  # ~2.5 min on 2 cores: three Ray clusters
def test_three_cells_at_once_on_three_private_clusters_all_complete(tmp_path):
    """Three slots on one machine (issue #39): before each cluster had its
    own worker ports, one cell of three died in every run here (Ray's
    driver: "Failed to start the grpc server. The specified port is 10002";
    Flower: "No heartbeat received from the task" or a ServerApp ended after
    0 rounds); on an H200 two of three, twice."""
    from tests.helpers import pids_under

    path = _write(tmp_path, SLOTS_SUITE)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            str(VENV_BIN / "fedadapt-exp"),
            "run",
            str(path),
            "--output",
            str(out),
            "--app",
            str(ROOT),
            "--parallel",
            "3",
            "--federation-config",
            "init-args-num-cpus=3 client-resources-num-cpus=1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = done.stdout[-4000:] + done.stderr[-4000:]
    assert "3 cell(s) at once on 3 Ray cluster(s)" in done.stdout, text
    assert done.returncode == 0, text
    statuses = {
        r.parent.name: json.loads(r.read_text())["status"]
        for r in (out / "slots").glob("*/results.json")
    }
    assert statuses == {f"{m}__default__seed0": "completed" for m in "abc"}, text
    assert pids_under(out) == {}


@pytest.mark.parametrize(
    "path", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.stem
)
def test_shipped_suites_are_valid(path):
    suite = load_suite(path)
    assert suite.description and suite.cells(ROOT / "outputs")


def test_federation_config_reaches_every_flwr_run(tmp_path, monkeypatch):
    """``--federation-config`` (client resources on a GPU machine) is passed to
    each cell's ``flwr run --federation-config`` beside num-supernodes."""

    commands = _flower_whose_runs_fail(monkeypatch)
    path = _write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]"))
    code = main(
        [
            "run",
            str(path),
            "--output",
            str(tmp_path / "out"),
            "--federation-config",
            "client-resources-num-gpus=0.5",
        ]
    )
    assert code == 1  # every (fake) run failed
    assert len(commands) == 3
    for command in commands:
        given = command[command.index("--federation-config") + 1]
        # the suite's one CPU a client filled in (SUITE_CLIENT_CPUS)
        assert given == (
            "num-supernodes=3 client-resources-num-gpus=0.5 client-resources-num-cpus=1"
        )


def test_a_setting_flower_refuses_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """``--federation-config`` with a key Flower rejects: exit 2 and Flower's
    message, not a traceback."""
    from fedadapt.tools import submission as cli

    def refusing_flwr(args, env, **kw):
        raise RuntimeError("flwr run failed (1): Unknown simulation config field(s)")

    fake_ray(monkeypatch)
    monkeypatch.setattr(cli, "SimulationSuperLink", FakeSuperLink)
    monkeypatch.setattr(cli, "flwr", refusing_flwr)
    path = _write(tmp_path)
    code = main(
        [
            "run",
            str(path),
            "--output",
            str(tmp_path / "out"),
            "--federation-config",
            "no-such-field=1",
        ]
    )
    assert code == 2
    assert "Unknown simulation config field" in capsys.readouterr().err


def _fake_suite_run(tmp_path, monkeypatch, cpus, gpus, *flags):
    """Run the 3-cell suite on a fake cluster; return (exit code, the
    federation configs the cells got, the cluster class, the most cells
    that were running at once)."""
    import threading

    lock, running = threading.Lock(), {"now": 0, "most": 0}

    def one_run_lasts_a_while():
        with lock:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        time.sleep(0.3)
        with lock:
            running["now"] -= 1

    commands = _flower_whose_runs_fail(monkeypatch, cpus, gpus, one_run_lasts_a_while)
    path = _write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]"))
    code = main(["run", str(path), "--output", str(tmp_path / "out"), *flags])
    configs = [c[c.index("--federation-config") + 1] for c in commands]
    return code, configs, commands.cluster, running["most"]


def test_a_suite_starts_its_clusters_once_not_once_per_cell(tmp_path, monkeypatch):
    """Issue #39: private clusters for the suite (not one per cell): on 12
    CPUs with 1-CPU clients, 3 cells run at once (one slot per four cores),
    each slot its own cluster of 4 CPUs; the cells' federation config is the
    given one."""
    code, configs, cluster, most = _fake_suite_run(
        tmp_path,
        monkeypatch,
        12,
        0,
        "--federation-config",
        "client-resources-num-cpus=1",
    )
    assert code == 1 and cluster.started == 3
    assert configs == ["num-supernodes=3 client-resources-num-cpus=1"] * 3
    assert most == 3


def test_parallel_bounds_the_cells_at_once(tmp_path, monkeypatch):
    code, configs, cluster, most = _fake_suite_run(
        tmp_path,
        monkeypatch,
        4,
        0,
        "--parallel",
        "2",
        "--federation-config",
        "client-resources-num-cpus=1",
    )
    assert cluster.started == 2 and most == 2
    assert len(configs) == 3


def test_a_machine_that_holds_one_client_runs_one_cell_at_a_time(tmp_path, monkeypatch):
    """Flower's default client (2 CPUs, said explicitly) on 2 cores: one slot,
    one cluster; the suite keeps the user's 2."""
    code, configs, cluster, most = _fake_suite_run(
        tmp_path,
        monkeypatch,
        2,
        0,
        "--federation-config",
        "client-resources-num-cpus=2",
    )
    assert cluster.started == 1 and most == 1
    assert configs == ["num-supernodes=3 client-resources-num-cpus=2"] * 3


def test_a_suites_clients_reserve_one_cpu_by_default(tmp_path, monkeypatch):
    """Without a federation config each cell's flwr run gets one CPU a
    client (two one-thread actors on 2 cores, not Flower's one two-thread
    actor); on 2 cores still one slot."""
    code, configs, cluster, most = _fake_suite_run(tmp_path, monkeypatch, 2, 0)
    assert cluster.started == 1 and most == 1
    assert configs == ["num-supernodes=3 client-resources-num-cpus=1"] * 3


def test_gpu_clients_share_the_gpus_across_slots(tmp_path, monkeypatch):
    """Two slots on one GPU: each client's share doubles, so the two slots'
    pools (each sized by Flower against the one GPU) fit it together."""
    code, configs, cluster, most = _fake_suite_run(
        tmp_path,
        monkeypatch,
        16,
        1,
        "--parallel",
        "2",
        "--federation-config",
        "client-resources-num-cpus=2 client-resources-num-gpus=0.25",
    )
    assert cluster.started == 2
    want = "num-supernodes=3 client-resources-num-cpus=2 client-resources-num-gpus=0.5"
    assert configs == [want] * 3


def test_a_slots_next_cell_starts_while_flower_ends_the_last(tmp_path, monkeypatch):
    """Issue #39: a cell gives its slot to the next one as soon as its
    results.json says it completed, not when Flower reports the run
    finished (Flower's process shuts down for 3–4 s more on 2 cores); one
    cell's rounds at a time all the same, and every cell still ends with
    Flower's verdict. The fake Flower's ServerApp completes 0.2 s after
    the submission; Flower reports the run finished 1 s after that."""
    import threading

    from fedadapt._atomic import atomic_write_text
    from fedadapt.tools import submission as cli

    fake_ray(monkeypatch, 2, 0)  # one slot
    events, lock = [], threading.Lock()

    def note(what, run_id):
        with lock:
            events.append((time.monotonic(), what, run_id))

    def at(what, run_id):
        with lock:
            return [t for t, w, r in events if w == what and r == run_id]

    def serverapp(folder, run_id):
        def write(status, rounds):
            used = {"received": 3, "used": 3}
            data = {
                "run_id": run_id,
                "status": status,
                "rounds": [
                    {"round": i + 1, "eval": {"loss": 1.0}, "replies": used}
                    for i in range(rounds)
                ],
            }
            atomic_write_text(folder / "results.json", json.dumps(data))

        folder.mkdir(parents=True, exist_ok=True)
        write("running", 0)
        time.sleep(0.2)
        write("completed", 2)
        note("completed", run_id)

    def fake_flwr(args, env, **kw):
        assert args[0] == "run", args
        config = args[args.index("--run-config") + 1]
        out = json.loads(re.search(r'output-dir=("[^"]*")', config).group(1))
        name = json.loads(re.search(r'run-name=("[^"]*")', config).group(1))
        with lock:
            run_id = 1 + sum(w == "submitted" for _, w, _ in events)
        note("submitted", run_id)
        threading.Thread(
            target=serverapp, args=(Path(out) / name, run_id), daemon=True
        ).start()
        return json.dumps({"run-id": run_id})

    def flower_status(run_id, env, conn=None):
        done = at("completed", run_id)
        if done and time.monotonic() - done[0] >= 1.0:
            note("finished", run_id)
            return {"status": "finished:completed", "status-details": ""}
        return {"status": "running", "status-details": ""}

    monkeypatch.setattr(cli, "SimulationSuperLink", FakeSuperLink)
    monkeypatch.setattr(cli, "flwr", fake_flwr)
    monkeypatch.setattr(cli, "run_status", flower_status)
    monkeypatch.setattr(cli, "FIRST_STATUS_POLL_S", 0.05)
    monkeypatch.setattr(cli, "RESULTS_POLL_S", 0.05)
    path = _write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]"))
    assert main(["run", str(path), "--output", str(tmp_path / "out")]) == 0
    runs = sorted({r for _, w, r in events if w == "submitted"})
    assert runs == [1, 2, 3]
    for earlier, later in zip(runs, runs[1:], strict=False):
        submitted = at("submitted", later)[0]
        assert at("completed", earlier)[0] <= submitted < at("finished", earlier)[0]
    assert all(at("finished", r) for r in runs)


def test_a_given_cluster_is_used_and_never_started(tmp_path, monkeypatch):
    """With ``--ray-address`` nothing is started and the cells run one at a
    time (each run's actor pool takes the whole cluster)."""
    code, configs, cluster, most = _fake_suite_run(
        tmp_path, monkeypatch, 16, 0, "--ray-address", "127.0.0.9:6379"
    )
    assert cluster.started == 0
    assert configs == ["num-supernodes=3 client-resources-num-cpus=1"] * 3
    assert most == 1


def test_parallel_with_a_given_cluster_says_it_is_ignored(
    tmp_path, monkeypatch, capsys
):
    code, configs, cluster, most = _fake_suite_run(
        tmp_path,
        monkeypatch,
        16,
        0,
        "--ray-address",
        "127.0.0.9:6379",
        "--parallel",
        "3",
    )
    assert most == 1 and cluster.started == 0
    assert "--parallel 3 ignored with --ray-address" in capsys.readouterr().err


def test_init_args_with_a_given_cluster_is_a_clear_error(tmp_path, monkeypatch, capsys):
    code, configs, _, _ = _fake_suite_run(
        tmp_path,
        monkeypatch,
        2,
        0,
        "--ray-address",
        "127.0.0.9:6379",
        "--federation-config",
        "init-args-num-cpus=4",
    )
    assert code == 2 and configs == []
    assert "init-args-num-cpus" in capsys.readouterr().err


def test_each_slot_has_its_own_superlink_home(tmp_path, monkeypatch):
    """Each slot's SuperLink writes its connection into its own FLWR_HOME:
    with one shared config.toml every status query went to the SuperLink
    started last ("Run ID not found" for the other slot's cells)."""
    from fedadapt.tools import submission as cli

    homes = []

    class Recording(FakeSuperLink):
        def __init__(self, flwr_home, *args, **kwargs):
            super().__init__(flwr_home, *args, **kwargs)
            homes.append(flwr_home)

    _flower_whose_runs_fail(monkeypatch, 12, 0)
    monkeypatch.setattr(cli, "SimulationSuperLink", Recording)
    path = _write(tmp_path, SUITE.replace("seeds: [0, 1]", "seeds: [0]"))
    main(["run", str(path), "--output", str(tmp_path / "out"),
          "--federation-config", "client-resources-num-cpus=1"])  # fmt: skip
    assert len(homes) == 3 and len(set(homes)) == 3, homes
