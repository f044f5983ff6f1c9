"""docs/baselines.md: one Flower-baseline-shaped section per covered suite."""

from __future__ import annotations

import re

import pytest

from fedadapt.tools import baselines
from fedadapt.tools.experiments import load_suite
from tests.helpers import ROOT


def test_page_is_up_to_date():
    assert (ROOT / baselines.PAGE).read_text() == baselines.render(), (
        "run: python -m fedadapt.tools.baselines --write"
    )


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "docs" / "baselines.md"
    stale.parent.mkdir()
    stale.write_text("# old\n")
    monkeypatch.setattr(baselines, "ROOT", tmp_path)
    monkeypatch.setattr(baselines, "render", lambda: "# new\n")
    assert baselines.main(["--check"]) == 1
    assert "--write" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("FedDuA (DUA §5)", "feddua-dua-5"),
        ("Δ-SGD (ICLR §4)", "δ-sgd-iclr-4"),
        (
            "FedDuA + SCAFFOLD and FedDuA + Mime (DUA Fig. 4)",
            "feddua--scaffold-and-feddua--mime-dua-fig-4",
        ),
    ],  # fmt: skip
)
def test_anchor_is_githubs(heading, slug):
    assert baselines.anchor(heading) == slug


def test_every_suite_reproduction_md_names_has_a_complete_section():
    page = (ROOT / baselines.PAGE).read_text()
    reproduction = (ROOT / baselines.REPRODUCTION).read_text()
    headings = {
        baselines.anchor(h) for h in re.findall(r"^#+ (.+)$", reproduction, re.M)
    }
    named = {
        p.stem
        for p in (ROOT / "conf").glob("*.yaml")
        if f"conf/{p.name}" in reproduction
    }
    covered = {p.stem for p in baselines.covered_suites()}
    assert named <= covered and "demo" not in covered
    for stem in covered:
        suite = load_suite(ROOT / "conf" / f"{stem}.yaml")
        body = page.split(f"\n## {suite.name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("What it reproduces", "Hyperparameters", "Command",
                     "Expected results"):  # fmt: skip
            assert f"**{part}" in body, (suite.name, part)
        assert f"fedadapt-exp run conf/{stem}.yaml" in body
        for method in suite.methods:
            assert f"| {method} |" in body
        link = re.search(r"\(reproduction\.md#([^)]+)\)", body)
        assert link and link.group(1) in headings, (suite.name, link)
        for plot in baselines.RESULTS[suite.name].plots:
            assert (ROOT / "docs" / "img" / plot).is_file(), plot
