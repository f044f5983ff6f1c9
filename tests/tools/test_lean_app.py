"""The lean copy ``flwr run`` builds the FAB from (#39's start-up breakdown).

Oracle: Flower's own FAB builder. The FAB built from the lean copy must be
the FAB built from the app folder itself, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from fedadapt.tools.submission import lean_app
from tests.helpers import ROOT

# Flower 1.42 builds its pathspecs with a pattern class pathspec deprecates
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "toyapp"
version = "1.0.0"
dependencies = ["flwr>=1.41"]

[tool.flwr.app]
publisher = "someone"
{include}

[tool.flwr.app.components]
serverapp = "pkg.server:app"
clientapp = "pkg.client:app"
"""


def _toy_app(root, include='fab-include = ["pkg/**/*.py", "LICENSE"]'):
    """An app folder with a package, a licence and what a checkout piles up."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT.format(include=include))
    (root / ".gitignore").write_text(".venv/\n__pycache__/\n/outputs/\n")
    (root / "LICENSE").write_text("licence text\n")
    for name in ("pkg/__init__.py", "pkg/server.py", "pkg/client.py", "pkg/sub/x.py"):
        (root / name).write_text(f"# {name}\nVALUE = 1\n")
    (root / "pkg" / "notes.md").write_text("not a .py file: not in the FAB\n")
    (root / "pkg" / "link.py").symlink_to(root / "pkg" / "server.py")
    for junk in (".venv/lib", "outputs/run", "docs", "pkg/__pycache__"):
        (root / junk).mkdir(parents=True, exist_ok=True)
        (root / junk / "module.py").write_text("JUNK = 1\n")
    (root / "README.md").write_text("# toy\n")
    return root


def _sha(fab: bytes) -> str:
    return hashlib.sha256(fab).hexdigest()


def test_the_lean_copy_builds_the_same_fab_from_only_the_included_entries(tmp_path):
    app = _toy_app(tmp_path / "app")
    lean = lean_app(app, tmp_path / "lean")
    assert lean == tmp_path / "lean"
    copied = sorted(
        p.relative_to(lean).as_posix()
        for p in lean.rglob("*")
        if p.is_file() or p.is_symlink()
    )
    assert copied == [
        ".gitignore", "LICENSE", "pkg/__init__.py", "pkg/__pycache__/module.py",
        "pkg/client.py", "pkg/link.py", "pkg/notes.md", "pkg/server.py",
        "pkg/sub/x.py", "pyproject.toml",
    ]  # fmt: skip
    assert (lean / "pkg" / "link.py").is_symlink()  # Flower skips it in both
    assert _sha(build_fab_from_disk(lean)) == _sha(build_fab_from_disk(app))


@pytest.mark.parametrize(
    "include",
    ["", 'fab-include = ["**/*.py"]', 'fab-include = ["*/x.py", "LICENSE"]'],
)
def test_without_plain_include_roots_the_app_folder_is_used(tmp_path, include):
    app = _toy_app(tmp_path / "app", include)
    assert lean_app(app, tmp_path / "lean") == app
    assert not (tmp_path / "lean").exists()


def test_fedadapts_own_fab_is_the_same_from_the_lean_copy(tmp_path):
    """The checkout itself (with its .venv, build and outputs folders)."""
    lean = lean_app(ROOT, tmp_path / "lean")
    assert lean != ROOT
    assert _sha(build_fab_from_disk(lean)) == _sha(build_fab_from_disk(ROOT))


def test_a_submission_hands_flwr_run_the_lean_copy_and_removes_it(
    tmp_path, monkeypatch
):
    from fedadapt.tools import submission
    from tests.helpers import FakeSuperLink

    app = _toy_app(tmp_path / "app")
    seen = {}

    def fake_flwr(args, env, **kw):
        given = Path(args[1])
        seen["app"] = given
        seen["files"] = sorted(
            p.relative_to(given).as_posix() for p in given.rglob("*") if p.is_file()
        )
        return json.dumps({"success": False, "error-message": "refused here"})

    monkeypatch.setattr(submission, "flwr", fake_flwr)
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(RuntimeError, match="refused here"):
        submission.submit_run(
            FakeSuperLink(home), app, {"output-dir": str(tmp_path / "out")}, 3, 10.0
        )
    assert seen["app"] != app and seen["app"].is_relative_to(home)
    assert "pkg/server.py" in seen["files"]
    assert not any(f.startswith((".venv", "outputs", "docs")) for f in seen["files"])
    assert not seen["app"].exists()  # the copy goes once Flower has built the FAB


def test_copies_left_by_killed_submissions_are_removed_and_live_ones_kept(tmp_path):
    # a SIGKILLed submission cannot remove its copy: the next one does,
    # judging by the pid in the name; a live submitter's copy stays
    import subprocess
    import sys

    from fedadapt.tools.submission import remove_orphaned_apps

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"app-{int(ended.stdout)}-x1"
    live = tmp_path / f"app-{os.getpid()}-x2"
    other = tmp_path / "app-notapid-x3"  # not ours: left alone
    for folder in (dead, live, other):
        (folder / "app").mkdir(parents=True)
    assert remove_orphaned_apps(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()
