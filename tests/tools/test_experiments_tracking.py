"""fedadapt-exp with a tracker (#32): one tracked run per cell, grouped by suite."""

from __future__ import annotations

import pytest

from fedadapt.config import ConfigError
from fedadapt.tools.experiments import SuiteError, load_suite
from tests.tools.test_experiments import SUITE, _write


def test_each_cell_is_a_run_of_its_suites_group(tmp_path):
    suite = load_suite(_write(tmp_path), {"tracker": "tensorboard"})
    out = tmp_path / "out" / suite.name
    cells = suite.cells(out)
    for cell in cells:
        assert cell.overrides["tracker"] == "tensorboard"
        assert cell.overrides["tracker-group"] == suite.name
        assert cell.overrides["tracker-dir"] == str(out / "tracker")
    # the tracked run is named after its folder: one name per cell
    assert len({c.overrides["run-name"] for c in cells}) == len(cells)


def test_a_suites_own_tracker_dir_is_kept_and_the_group_is_the_runners(tmp_path):
    text = SUITE.replace("clients-per-round: 3}", "clients-per-round: 3, "
                         "tracker-dir: /srv/tb}")  # fmt: skip
    suite = load_suite(_write(tmp_path, text))
    assert {c.overrides["tracker-dir"] for c in suite.cells(tmp_path)} == {"/srv/tb"}
    with pytest.raises(SuiteError, match="tracker-group"):
        load_suite(_write(tmp_path, SUITE), {"tracker-group": "mine"})


def test_a_missing_tracker_package_fails_the_suite_before_any_cell(
    tmp_path, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mlflow" else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"pip install 'fedadapt\[mlflow\]'"):
        load_suite(_write(tmp_path), {"tracker": "mlflow"})
