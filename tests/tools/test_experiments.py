"""Experiment suites: validation, grid expansion, resume, report and claims."""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest

from fedadapt.config import ConfigError
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
from tests.helpers import ROOT, VENV_BIN

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
    assert "| sgd | client-lr=0.1 | 0.4 ± 0.14 | 2 |" in report
    assert (out / "tiny" / "report.png").stat().st_size > 3000


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


@pytest.mark.e2e
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


@pytest.mark.parametrize(
    "path", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.stem
)
def test_shipped_suites_are_valid(path):
    suite = load_suite(path)
    assert suite.description and suite.cells(ROOT / "outputs")


def test_federation_config_reaches_every_flwr_run(tmp_path, monkeypatch):
    """``--federation-config`` (client resources on a GPU machine) is passed to
    each cell's ``flwr run --federation-config`` beside num-supernodes."""
    from fedadapt.tools import submission as cli

    commands = []

    class FakeSuperLink:
        flwr_home, address, connection = tmp_path / "home", "127.0.0.1:1", "fake"
        root_certificates, simulation = None, True

        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    def fake_flwr(args, env, **kw):
        if args[0] == "run":
            commands.append(list(args))
            return json.dumps({"run-id": len(commands)})
        raise AssertionError(args)

    monkeypatch.setattr(cli, "SimulationSuperLink", FakeSuperLink)
    monkeypatch.setattr(cli, "flwr", fake_flwr)
    monkeypatch.setattr(
        cli,
        "run_status",
        lambda *a: {"status": "finished:failed", "status-details": ""},
    )
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
        assert given == "num-supernodes=3 client-resources-num-gpus=0.5"


def test_a_setting_flower_refuses_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """``--federation-config`` with a key Flower rejects: exit 2 and Flower's
    message, not a traceback."""
    from fedadapt.tools import submission as cli

    class FakeSuperLink:
        flwr_home, address, connection = tmp_path / "home", "127.0.0.1:1", "fake"
        root_certificates, simulation = None, True

        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    def refusing_flwr(args, env, **kw):
        raise RuntimeError("flwr run failed (1): Unknown simulation config field(s)")

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
