"""The code blocks README.md and docs/extending.md mark runnable run as written (#42).

A block is runnable when the line before its opening fence is an HTML
comment starting with ``<!-- runnable``. Python blocks run in a fresh
interpreter (this project importable, a temporary working directory); bash
blocks run with ``bash -euo pipefail`` in the repository, the venv's
programs first on PATH. Each must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

DOCS = ("README.md", "docs/extending.md")
BLOCK = re.compile(r"<!-- runnable[^\n]*-->\n```(python|bash)\n(.*?)```", re.S)


def runnable_blocks() -> list[tuple[str, int, str, str]]:
    """(file, line, language, code) of every block marked runnable."""
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            found.append((name, line, match[1], match[2]))
    return found


BLOCKS = runnable_blocks()


def test_the_docs_mark_blocks_runnable():
    assert {name for name, *_ in BLOCKS} == set(DOCS), BLOCKS


@pytest.mark.parametrize(
    ("name", "line", "language", "code"), BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BLOCKS]
)
def test_a_runnable_block_runs_as_written(tmp_path, name, line, language, code):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
    }
    command = (
        [sys.executable, "-c", code]
        if language == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    done = subprocess.run(
        command,
        cwd=tmp_path if language == "python" else ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"{name}:{line}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    )
