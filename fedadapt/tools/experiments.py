"""Experiment suites: YAML grids of runs, a resumable runner, tables and plots.

A suite (``conf/<suite>.yaml``) names a base run config, methods (run-config
overrides; a list value is a grid axis), seeds, rounds, the metric to
compare and optionally the paper's claims. ``fedadapt-exp run`` runs every
cell through the Flower simulation (one private SuperLink per suite, one
``flwr run`` per cell), skipping cells already finished, so it is safe to
interrupt and resume. ``fedadapt-exp report`` writes ``report.md`` (mean ±
std over seeds, the best grid point per method), ``report.json`` and
``report.png``, and checks the claims. ``--set key=value`` (repeatable)
overrides a run-config key in every cell and names the variant, e.g.
``fedadapt-exp run conf/delta-sgd-mnist.yaml --set dirichlet-alpha=0.01``.
``--methods a,b`` and ``--seeds 1,2`` run (and report) part of a suite:
its cells keep their names, so a later run of the whole suite skips them.
``--set tracker=tensorboard`` (or wandb, mlflow) tracks each cell as one run
named after the cell, grouped by suite, in ``<suite output>/tracker``
(docs/trackers.md).

Suite keys::

    name: feddua-synthetic-smoke     # output folder name
    description: ...                 # what it reproduces (paper, table/figure)
    num-supernodes: 20               # clients
    rounds: 60                       # num-server-rounds of every cell
    seeds: [0, 1]
    metric: eval-loss                # eval-loss | eval-accuracy | train-loss
    last: 5                          # average the metric over the last 5 evaluations
    base: {task: synthetic-linreg, ...}          # run-config overrides
    methods: {fedavg: {strategy: fedavg, client-lr: [0.01, 0.1]}, ...}
    claims:                          # optional, checked by the report
      - {method: feddua, beats: [fedavg, fedexp], factor: 1.0, note: "..."}
      # min metric: mine·factor ≤ theirs + margin; max: mine ≥ theirs·factor − margin
    timeout: 900                     # seconds per cell
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedadapt.config import KEYS, ConfigError, validate_run_config
from fedadapt.server.tracking import check_tracker

SUITE_KEYS = {
    "name",
    "description",
    "num-supernodes",
    "rounds",
    "seeds",
    "metric",
    "base",
    "methods",
    "claims",
    "timeout",
    "last",
}
CLAIM_KEYS = {"method", "beats", "factor", "margin", "note", "known-deviation"}
METRICS = {"eval-loss": "min", "eval-accuracy": "max", "train-loss": "min"}
RUN_OWNED = (
    "seed",
    "num-server-rounds",
    "output-dir",
    "run-name",
    "overwrite",
    "tracker-group",
)


class SuiteError(ValueError):
    """A suite file is malformed; the message names the offending key."""


@dataclass(frozen=True)
class Cell:
    """One run of a suite: a method, a grid point and a seed."""

    method: str
    point: tuple[tuple[str, Any], ...]
    seed: int
    overrides: Mapping[str, Any]

    @property
    def point_label(self) -> str:
        """Grid point as ``key=value,...`` ("default" when no grid)."""
        return ",".join(f"{k}={v}" for k, v in self.point) or "default"

    @property
    def run_name(self) -> str:
        """Folder name of the cell inside the suite's output folder."""
        label = self.point_label.replace("/", "_").replace("=", "-").replace(",", "_")
        return f"{self.method}__{label}__seed{self.seed}"


@dataclass
class Suite:
    """A parsed, validated suite."""

    name: str
    description: str
    num_supernodes: int
    rounds: int
    seeds: list[int]
    metric: str
    base: dict[str, Any]
    methods: dict[str, dict[str, Any]]
    claims: list[dict[str, Any]] = field(default_factory=list)
    timeout: float = 900.0
    last: int = 1

    def cells(self, output_dir: Path) -> list[Cell]:
        """Every (method, grid point, seed) with its full run-config overrides."""
        cells = []
        for method, spec in self.methods.items():
            axes = {k: v for k, v in spec.items() if isinstance(v, list)}
            fixed = {k: v for k, v in spec.items() if not isinstance(v, list)}
            for values in itertools.product(*axes.values()):
                point = tuple(zip(axes, values, strict=True))
                for seed in self.seeds:
                    cell = Cell(method, point, seed, {})
                    overrides = {**self.base, **fixed, **dict(point)}
                    overrides.update(
                        {
                            "seed": seed,
                            "num-server-rounds": self.rounds,
                            "output-dir": str(output_dir),
                            "run-name": cell.run_name,
                            # with `tracker` set (--set tracker=tensorboard):
                            # one tracked run per cell, grouped by suite
                            "tracker-dir": overrides.get("tracker-dir")
                            or str(output_dir / "tracker"),
                            "tracker-group": self.name,
                        }
                    )
                    cells.append(Cell(method, point, seed, overrides))
        return cells


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise SuiteError(f"Invalid suite key '{key}': {message}")


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``--set key=value`` items; values are YAML scalars (0.01, true, x)."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        _require(bool(sep) and bool(key), f"--set {item}", "expected key=value")
        settings[key.strip()] = yaml.safe_load(value)
    return settings


def load_suite(path: str | Path, settings: Mapping[str, Any] | None = None) -> Suite:
    """Read and validate a suite; every cell's run config is checked too.

    ``settings`` (``fedadapt-exp --set``) override run-config keys in every
    cell, after the base and the methods (a grid axis they set collapses to
    one point); they are appended to the suite's name, so each variant of a
    suite (e.g. another Dirichlet α) gets its own output folder.

    Raises SuiteError (unknown or malformed suite keys) or ConfigError (a
    cell's run config is invalid), naming the key, before anything runs.
    """
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    _require(isinstance(data, dict), "(file)", "expected a mapping at the top")
    settings = dict(settings or {})
    for key in settings:
        _require(key in KEYS, f"--set {key}", "not a run-config key")
        _require(
            key not in RUN_OWNED,
            f"--set {key}",
            "set by the suite (seeds, rounds) and the runner",
        )
    for key in data:
        _require(key in SUITE_KEYS, key, f"unknown. Valid keys: {sorted(SUITE_KEYS)}")
    for key in ("name", "methods", "base"):
        _require(key in data, key, "missing")
    _require(
        isinstance(data["methods"], dict) and bool(data["methods"]),
        "methods",
        "expected a non-empty mapping of method name to overrides",
    )
    metric = data.get("metric", "eval-loss")
    _require(metric in METRICS, "metric", f"one of {sorted(METRICS)}")
    seeds = data.get("seeds", [0])
    _require(
        isinstance(seeds, list) and all(isinstance(s, int) for s in seeds),
        "seeds",
        "expected a list of integers",
    )
    for owned in RUN_OWNED:
        for where, overrides in [("base", data["base"]), *data["methods"].items()]:
            _require(
                owned not in (overrides or {}),
                f"{where}.{owned}",
                "set by the suite (seeds, rounds) and the runner",
            )
    claims = data.get("claims", []) or []
    for claim in claims:
        for key in claim:
            _require(key in CLAIM_KEYS, f"claims.{key}", f"valid: {sorted(CLAIM_KEYS)}")
        _require(
            claim.get("method") in data["methods"],
            "claims.method",
            f"{claim.get('method')!r} is not a method of this suite",
        )
        for other in claim.get("beats", []):
            _require(other in data["methods"], "claims.beats", f"unknown {other!r}")
    if settings:
        data["name"] = "__".join(
            [str(data.get("name")), *(f"{k}-{v}" for k, v in settings.items())]
        )
        data["methods"] = {
            m: {**(spec or {}), **settings} for m, spec in data["methods"].items()
        }
    suite = Suite(
        name=str(data["name"]),
        description=str(data.get("description", "")),
        num_supernodes=int(data.get("num-supernodes", 10)),
        rounds=int(data.get("rounds", 20)),
        seeds=seeds,
        metric=metric,
        base=dict(data["base"]),
        methods={k: dict(v or {}) for k, v in data["methods"].items()},
        claims=claims,
        timeout=float(data.get("timeout", 900)),
        last=int(data.get("last", 1)),
    )
    for cell in suite.cells(Path("/validate")):
        try:
            validate_run_config(cell.overrides)
            check_tracker(cell.overrides)  # a missing extra: fail before any cell
        except ConfigError as error:
            raise ConfigError(error.key, f"{error} (method {cell.method!r})") from None
        _require(
            cell.overrides.get("clients-per-round", 0) <= suite.num_supernodes,
            "num-supernodes",
            "smaller than clients-per-round",
        )
    return suite


def select(
    suite: Suite,
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
) -> Suite:
    """Return the part of ``suite`` with only these methods and/or seeds.

    ``fedadapt-exp run|report --methods a,b --seeds 1,2``: a full paper suite
    is days of CPU time, so one can run (and report) the cells that matter
    first; cells keep their names and folders, so a later run of the whole
    suite skips them. A claim whose methods are not all selected reports
    "missing". Raises SuiteError naming an unknown method, an empty list or a
    repeated seed, ConfigError for a seed the run config refuses.
    """
    chosen = dict(suite.methods)
    if methods is not None:
        _require(bool(methods), "--methods", "expected at least one method")
        for method in methods:
            _require(
                method in suite.methods,
                "--methods",
                f"unknown method {method!r}; the suite has {sorted(suite.methods)}",
            )
        chosen = {m: spec for m, spec in suite.methods.items() if m in methods}
    if seeds is not None:
        _require(bool(seeds), "--seeds", "expected at least one seed")
        _require(
            len(set(seeds)) == len(seeds),
            "--seeds",
            f"a seed given twice would run a cell twice: {seeds}",
        )
    part = dataclasses.replace(
        suite, methods=chosen, seeds=list(suite.seeds if seeds is None else seeds)
    )
    for cell in part.cells(Path("/validate")):  # e.g. a negative seed
        try:
            validate_run_config(cell.overrides)
            check_tracker(cell.overrides)  # a missing extra: fail before any cell
        except ConfigError as error:
            raise ConfigError(error.key, f"{error} (--seeds)") from None
    return part


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _seed_list(text: str) -> list[int]:
    try:
        return [int(item) for item in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


# --- running -------------------------------------------------------------------


def cell_done(results: Path, rounds: int) -> bool:
    """Whether a cell's results.json says it completed all its rounds."""
    try:
        data = json.loads(results.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return data.get("status") == "completed" and len(data.get("rounds", [])) == rounds


def run_suite(
    suite: Suite,
    output_root: Path,
    app: Path,
    federation_config: str = "",
    parallel: int = 1,
) -> int:
    """Run every unfinished cell; return the number of failed cells.

    ``federation_config`` is passed to every ``flwr run`` (its
    ``--federation-config``), e.g. ``"client-resources-num-gpus=0.25"`` so
    that four simulated clients share each GPU; without it Ray gives the
    clients no GPU and they train on the CPU. ``parallel`` cells run at once
    on the suite's SuperLink (each its own simulation process): a cell spends
    most of its first ~25 s starting Flower and Ray, which overlaps well.
    Seeded cells give the same numbers whatever runs beside them.
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    from fedadapt.tools.submission import SimulationSuperLink, submit_run

    out = (output_root / suite.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cells = suite.cells(out)
    todo = [
        c
        for c in cells
        if not cell_done(out / c.run_name / "results.json", suite.rounds)
    ]
    print(
        f"{suite.name}: {len(cells)} cells, {len(cells) - len(todo)} already done; "
        f"Flower's logs in {out / '.flwr'}",
        flush=True,
    )
    failed = 0
    if not todo:
        return 0
    with SimulationSuperLink(out / ".flwr") as superlink:

        def run(cell: Cell) -> tuple[Cell, Any]:
            # a cell not done replaces its failed or stopped attempt in its
            # folder (a live one is still refused: docs/failures.md)
            overrides = {**cell.overrides, "overwrite": True}
            return cell, submit_run(
                superlink,
                app,
                overrides,
                suite.num_supernodes,
                suite.timeout,
                federation_config=federation_config,
            )

        bar = tqdm(total=len(todo), desc=suite.name, unit="cell", file=sys.stdout)
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for future in as_completed([pool.submit(run, c) for c in todo]):
                cell, outcome = future.result()
                bar.update()
                bar.set_postfix_str(f"{cell.method} {cell.point_label} done")
                if not outcome.ok:
                    failed += 1
                    tqdm.write(
                        f"FAILED {cell.run_name}: {outcome.status} "
                        f"{outcome.details} {outcome.problems}"
                    )
        bar.close()
    return failed


# --- reporting -----------------------------------------------------------------


def _series(results: Mapping[str, Any], metric: str) -> list[tuple[int, float]]:
    phase, key = (
        ("train", "train-loss")
        if metric == "train-loss"
        else ("eval", metric.removeprefix("eval-"))
    )
    points = []
    for entry in results.get("rounds", []):
        values = entry.get(phase) or {}
        if key in values and values[key] is not None:
            points.append((entry["round"], float(values[key])))
    return points


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return mean, math.sqrt(var)


def summarise(suite: Suite, output_root: Path) -> dict[str, Any]:
    """Per method: every grid point's final metric over seeds, and the best."""
    out = output_root / suite.name
    better = min if METRICS[suite.metric] == "min" else max
    methods: dict[str, Any] = {}
    for cell in suite.cells(out):
        path = out / cell.run_name / "results.json"
        if not cell_done(path, suite.rounds):
            continue
        series = _series(json.loads(path.read_text()), suite.metric)
        if not series:
            continue
        point = methods.setdefault(cell.method, {}).setdefault(
            cell.point_label, {"final": [], "curves": []}
        )
        tail = [value for _, value in series[-suite.last :]]
        point["final"].append(sum(tail) / len(tail))
        point["curves"].append(series)
    summary: dict[str, Any] = {
        "suite": suite.name,
        "metric": suite.metric,
        "methods": {},
    }
    for method, points in methods.items():
        stats = {
            label: {
                "mean": _mean_std(p["final"])[0],
                "std": _mean_std(p["final"])[1],
                "seeds": len(p["final"]),
                "curves": p["curves"],
            }
            for label, p in points.items()
        }
        best = better(stats, key=lambda label: stats[label]["mean"])
        summary["methods"][method] = {"best": best, "points": stats}
    summary["claims"] = [check_claim(c, summary, suite.metric) for c in suite.claims]
    return summary


def check_claim(
    claim: Mapping[str, Any], summary: Mapping[str, Any], metric: str
) -> dict[str, Any]:
    """Evaluate one claim on the best grid points: holds, fails or missing."""
    methods = summary["methods"]
    factor = float(claim.get("factor", 1.0))
    margin = float(claim.get("margin", 0.0))
    result = {**claim, "status": "holds", "details": []}
    if claim["method"] not in methods:
        return {**result, "status": "missing"}
    mine = methods[claim["method"]]["points"][methods[claim["method"]]["best"]]["mean"]
    for other in claim.get("beats", []):
        if other not in methods:
            result["status"] = "missing"
            continue
        theirs = methods[other]["points"][methods[other]["best"]]["mean"]
        if METRICS[metric] == "min":
            ok = mine * factor <= theirs + margin
        else:
            ok = mine >= theirs * factor - margin
        result["details"].append(
            f"{claim['method']} {mine:.4g} vs {other} {theirs:.4g}"
        )
        if not ok and result["status"] == "holds":
            result["status"] = "fails"
    if result["status"] == "fails" and claim.get("known-deviation"):
        result["status"] = "fails (known deviation)"
    return result


def write_report(suite: Suite, output_root: Path) -> dict[str, Any]:
    """Write report.md, report.json and report.png; return the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = output_root / suite.name
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(suite, output_root)
    lines = [
        f"# {suite.name}",
        "",
        suite.description,
        "",
        f"Final {suite.metric} after {suite.rounds} rounds (mean of the last "
        f"{suite.last} evaluations), mean ± std over seeds {suite.seeds}; for "
        "grids, the best grid point per method.",
        "",
        "| method | best grid point | final metric | seeds |",
        "|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, info in summary["methods"].items():
        best = info["points"][info["best"]]
        lines.append(
            f"| {method} | {info['best']} | {best['mean']:.4g} ± "
            f"{best['std']:.2g} | {best['seeds']} |"
        )
        rounds = [r for r, _ in best["curves"][0]]
        mean = [
            sum(c[i][1] for c in best["curves"]) / len(best["curves"])
            for i in range(len(rounds))
        ]
        ax.plot(rounds, mean, label=f"{method} ({info['best']})")
    if summary["claims"]:
        lines += ["", "## Claims", ""]
        for claim in summary["claims"]:
            remarks = "".join(
                f" — {claim[key]}"
                for key in ("note", "known-deviation")
                if claim.get(key)
            )
            lines.append(
                f"- **{claim['status']}**: {claim['method']} beats "
                f"{', '.join(claim.get('beats', []))} "
                f"({'; '.join(claim['details'])}){remarks}"
            )
    ax.set_xlabel("round")
    ax.set_ylabel(suite.metric)
    if METRICS[suite.metric] == "min":
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(suite.name)
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=100)
    plt.close(fig)
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    slim = json.loads(json.dumps(summary))
    for info in slim["methods"].values():
        for point in info["points"].values():
            point.pop("curves")
    (out / "report.json").write_text(json.dumps(slim, indent=2), encoding="utf-8")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """``fedadapt-exp run|report|check SUITE.yaml``."""
    parser = argparse.ArgumentParser(prog="fedadapt-exp", description=__doc__)
    parser.add_argument("command", choices=("run", "report", "validate"))
    parser.add_argument("suite", type=Path, help="conf/<suite>.yaml")
    parser.add_argument("--output", type=Path, default=Path("outputs/experiments"))
    parser.add_argument("--app", type=Path, default=Path("."))
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a claim fails (known deviations excepted)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run-config key in every cell (e.g. dirichlet-alpha=0.01); "
        "the variant gets its own output folder",
    )
    parser.add_argument(
        "--federation-config",
        default="",
        metavar='"KEY=VALUE ..."',
        help="simulation settings for every run (flwr run --federation-config), "
        'e.g. "client-resources-num-gpus=0.25 client-resources-num-cpus=2" on a '
        "GPU machine (without it the simulated clients get no GPU)",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="run N cells at once (each its own simulation; default 1)",
    )
    parser.add_argument(
        "--methods",
        type=_csv,
        default=None,
        metavar="A,B",
        help="only these methods' cells (run and report); default: all",
    )
    parser.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="0,1",
        help="these seeds instead of the suite's (run and report)",
    )
    args = parser.parse_args(argv)
    try:
        suite = load_suite(args.suite, parse_settings(args.set))
        suite = select(suite, args.methods, args.seeds)
    except (SuiteError, ConfigError, yaml.YAMLError, OSError) as error:
        print(f"fedadapt-exp: {error}", file=sys.stderr)
        return 2
    output = args.output.resolve()
    if args.command == "validate":
        print(f"{suite.name}: {len(suite.cells(output))} cells, valid")
        return 0
    if args.command == "run":
        started = time.monotonic()
        try:
            failed = run_suite(
                suite,
                output,
                args.app.resolve(),
                args.federation_config,
                args.parallel,
            )
        except RuntimeError as error:  # flwr refused the run (e.g. a bad setting)
            print(f"fedadapt-exp: {error}", file=sys.stderr)
            return 2
        print(
            f"{suite.name}: finished in {time.monotonic() - started:.0f}s, "
            f"{failed} failed"
        )
        if failed:
            return 1
    summary = write_report(suite, output)
    print((output / suite.name / "report.md").read_text())
    print(f"plot: {output / suite.name / 'report.png'}")
    if args.check and any(
        c["status"] in ("fails", "missing") for c in summary["claims"]
    ):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
