"""What we ship (issue #27): the Flower versions we declare and test, the
licence, and the FAB / Flower Hub upload checked by Flower's own code."""

from __future__ import annotations

import io
import os
import re
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import ROOT

# Flower's pathspec patterns, not ours
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pathspec")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# git-ignored folders that may be huge (a venv, datasets, outputs): not walked
IGNORED_DIRS = {
    ".git",
    ".venv",
    "build",
    "dist",
    "outputs",
    "results",
    "certs",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
}


def _flwr(requirements: list[str]) -> Requirement:
    (flwr,) = [r for r in map(Requirement, requirements) if r.name == "flwr"]
    return flwr


def _tested_versions() -> list[Version]:
    makefile = (ROOT / "Makefile").read_text()
    line = re.search(r"^FLOWER_VERSIONS := (.+)$", makefile, re.M)
    assert line, "Makefile: FLOWER_VERSIONS not found"
    return sorted(Version(v) for v in line.group(1).split())


def test_declared_flower_range_is_what_ci_tests():
    """The library allows the user's Flower from the oldest tested release on;
    CI tests that oldest and the newest, which the app pins and the FAB targets."""
    base = _flwr(PYPROJECT["project"]["dependencies"])
    app = _flwr(PYPROJECT["project"]["optional-dependencies"]["app"])
    tested = _tested_versions()
    lower = [Version(s.version) for s in base.specifier if s.operator == ">="]
    assert lower == [tested[0]], f"{base} vs FLOWER_VERSIONS {tested}"
    assert all(base.specifier.contains(v) for v in tested)
    assert not any(s.operator == "==" for s in base.specifier), "a pin downgrades"
    (pin,) = [Version(s.version) for s in app.specifier if s.operator == "=="]
    assert pin == tested[-1]
    target = PYPROJECT["tool"]["flwr"]["app"]["flwr-version-target"]
    assert Version(target) == pin
    example = tomllib.loads((ROOT / "examples/plug_in/pyproject.toml").read_text())
    assert _flwr(example["project"]["dependencies"]).specifier == app.specifier


def _project_files() -> dict[str, Path]:
    """Flower's collect_files, without walking git-ignored bulk."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [
            d for d in dirnames if d not in IGNORED_DIRS and not d.startswith(".flwr")
        ]
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                files[path.relative_to(ROOT).as_posix()] = path
    return files


def test_fab_carries_the_licence_within_flower_limits():
    """Flower's own builder: the package, the licence and pyproject only,
    Flower Hub's format 1 metadata, under FAB_MAX_SIZE."""
    from flwr.cli.build import build_fab_from_files
    from flwr.common.constant import FAB_MAX_SIZE

    fab, metadata = build_fab_from_files(_project_files())
    assert len(fab) <= FAB_MAX_SIZE
    names = set(zipfile.ZipFile(io.BytesIO(fab)).namelist())
    assert {"LICENSE", "pyproject.toml", "fedadapt/strategies/__init__.py"} <= names
    assert not any(n.startswith(("tests/", "docs/", "examples/")) for n in names)
    assert metadata.fab_format_version == 1
    assert Version(metadata.flwr_version_min) == _tested_versions()[0]


def test_flower_hub_upload_checks_pass():
    """What `flwr app publish` validates before uploading the project:
    the declared licence file, the description, file count/size/encoding."""
    from flwr.cli.app_cmd.publish import (
        _get_declared_license_file,
        _validate_description,
        _validate_files,
    )
    from flwr.cli.utils import filter_paths_for_publish

    assert _get_declared_license_file(ROOT) == (ROOT / "LICENSE").resolve()
    _validate_description(PYPROJECT["project"]["description"])
    uploaded = filter_paths_for_publish(_project_files())
    assert "LICENSE" in uploaded
    _validate_files(list(uploaded.values()))  # raises click.ClickException


def test_licence_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert PYPROJECT["project"]["license"] == {"file": "LICENSE"}


def test_docker_image_installs_the_apps_flower_pin_once():
    """docker/requirements.py: the app's Flower pin (no Ray), not the library range."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / "docker/requirements.py"), str(ROOT)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = done.stdout.split()
    app = _flwr(PYPROJECT["project"]["optional-dependencies"]["app"])
    assert [line for line in lines if Requirement(line).name == "flwr"] == [
        f"flwr{app.specifier}"
    ]
    assert not any(Requirement(line).name in ("torch", "torchvision") for line in lines)
