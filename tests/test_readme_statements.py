"""Statements of the README a newcomer runs or compares against (#42)."""

from __future__ import annotations

import re

from fedadapt.tools.experiments import _table, load_suite
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
BASH = re.findall(r"```bash\n(.*?)```", README, re.S)
OURS = ("fedadapt", "fedadapt-exp", "tensorboard", "flwr", "ray")


def test_our_commands_in_the_readme_name_the_venv():
    """After ``make``, fedadapt's programs are in .venv/bin, not on PATH:
    every command line that starts one says so (or follows ``source
    .venv/bin/activate`` in its block)."""
    bare = []
    for block in BASH:
        if "source .venv/bin/activate" in block:
            continue
        for line in block.splitlines():
            word = line.strip().split(" ", 1)[0]
            if word in OURS[:3]:  # flwr/ray: only in activated or docker blocks
                bare.append(line)
    assert bare == [], bare


def test_the_demo_sample_output_has_the_reports_header():
    """The table the README shows for make demo is the one the report prints."""
    suite = load_suite(ROOT / "conf" / "demo.yaml")
    header = _table(suite, {"methods": {}})[0]
    demo = README.split("`make demo` runs", 1)[1].split("```", 2)[1]
    assert header in demo, (header, demo)
