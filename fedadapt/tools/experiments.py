"""Experiment suites: YAML grids of runs, a resumable runner, tables and plots.

A suite (``conf/<suite>.yaml``) names a base run config, methods (run-config
overrides; a list value is a grid axis), seeds, rounds, the metric to
compare and optionally the paper's claims. ``fedadapt-exp run`` runs every
cell through the Flower simulation (one private SuperLink per suite, one
``flwr run`` per cell), skipping cells already finished, so it is safe to
interrupt and resume. ``fedadapt-exp report`` writes ``report.md`` (mean ±
std over seeds, the best grid point per method), ``report.json`` and
``report.png`` (loss and accuracy panels), and checks the claims. With a
target (suite key ``target`` or ``--target accuracy=0.9``) it reports the
rounds and wall time each method needs to reach it, and with a baseline
(``baseline: fedavg`` or ``--baseline fedavg``) the speed-up against it:
FedExP's and FedDuA's headline claims are rounds to an accuracy, not the
final value. ``--set key=value`` (repeatable)
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
    target: {metric: accuracy, value: 0.9}  # optional: rounds/time to reach it
    baseline: fedavg                 # optional: speed-up against this method

Numbers in report.md share one format (4 significant digits); a spread over
seeds is written "mean ± std" only with two or more seeds, one seed's value
alone otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fedadapt._atomic import atomic_open, atomic_write_text
from fedadapt.config import KEYS, ConfigError, validate_run_config
from fedadapt.server.tracking import check_tracker

if TYPE_CHECKING:
    from fedadapt.tools.submission import RunOutcome

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
    "target",
    "baseline",
}
CLAIM_KEYS = {"method", "beats", "factor", "margin", "note", "known-deviation"}
METRICS = {
    "eval-loss": "min",
    "eval-accuracy": "max",
    "train-loss": "min",
    "train-accuracy": "max",
}
#: short names a target may use (central evaluation)
METRIC_ALIASES = {"accuracy": "eval-accuracy", "loss": "eval-loss"}
#: panels of report.png (those with data), besides the suite's metric and the target's
PANELS = ("eval-loss", "eval-accuracy", "train-loss")
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
class Target:
    """A value of a metric to reach: ≥ it for accuracies, ≤ it for losses."""

    metric: str
    value: float

    def reached(self, value: float) -> bool:
        """Whether ``value`` meets the target."""
        if METRICS[self.metric] == "max":
            return value >= self.value
        return value <= self.value

    @property
    def label(self) -> str:
        """``eval-accuracy ≥ 0.9`` style text for tables and plots."""
        sign = "≥" if METRICS[self.metric] == "max" else "≤"
        return f"{self.metric} {sign} {_num(self.value)}"


def parse_target(spec: Any, key: str = "target") -> Target:
    """Return the target of ``{metric: M, value: V}`` or ``"M=V"`` (``--target``).

    ``M`` is a report metric (:data:`METRICS`) or ``accuracy`` / ``loss``
    (central evaluation). Raises SuiteError naming ``key``.
    """
    if isinstance(spec, str):
        metric, sep, value = spec.partition("=")
        _require(bool(sep), key, f"expected METRIC=VALUE, got {spec!r}")
        spec = {"metric": metric.strip(), "value": yaml.safe_load(value)}
    _require(
        isinstance(spec, dict) and set(spec) == {"metric", "value"},
        key,
        "expected {metric: <metric>, value: <number>}",
    )
    metric = METRIC_ALIASES.get(spec["metric"], spec["metric"])
    _require(
        metric in METRICS,
        f"{key}.metric",
        f"one of {sorted([*METRICS, *METRIC_ALIASES])}, got {spec['metric']!r}",
    )
    value = spec["value"]
    _require(
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value),
        f"{key}.value",
        f"expected a finite number, got {value!r}",
    )
    return Target(metric, float(value))


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
    target: Target | None = None
    baseline: str | None = None

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
    target = None if data.get("target") is None else parse_target(data["target"])
    baseline = data.get("baseline")
    _require(
        baseline is None or baseline in data["methods"],
        "baseline",
        f"{baseline!r} is not a method of this suite",
    )
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
        target=target,
        baseline=baseline,
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


def report_options(
    suite: Suite, target: str | None = None, baseline: str | None = None
) -> Suite:
    """Return ``suite`` with ``--target METRIC=VALUE`` / ``--baseline M`` applied.

    They override the suite's ``target`` / ``baseline``; raises SuiteError
    naming the flag for a malformed target or an unknown method.
    """
    if target is not None:
        suite = dataclasses.replace(suite, target=parse_target(target, "--target"))
    if baseline is not None:
        _require(
            baseline in suite.methods,
            "--baseline",
            f"unknown method {baseline!r}; the suite has {sorted(suite.methods)}",
        )
        suite = dataclasses.replace(suite, baseline=baseline)
    return suite


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _seed_list(text: str) -> list[int]:
    try:
        return [int(item) for item in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


# --- running -------------------------------------------------------------------


def _stop_reason(error: BaseException) -> str:
    """Why a suite's unfinished cells were stopped, for their results.json."""
    from fedadapt.tools.submission import Terminated

    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C / SIGINT to fedadapt-exp)"
    if isinstance(error, Terminated):
        return f"fedadapt-exp stopped the suite: {error.reason}"
    return f"fedadapt-exp ended with an error: {error!r}"


def _visible_gpus() -> int:
    """GPUs this machine shows (0 without CUDA); imports torch only here."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


#: Run-config keys that say where a cell's results go and how it is run,
#: not what it computes: a suite moved to another folder, tracked elsewhere,
#: checkpointed or given longer timeouts is not rerun for it.
PLACEMENT_KEYS = frozenset(
    {"output-dir", "run-name", "overwrite", "tracker", "tracker-dir",
     "tracker-group", "checkpoint-every", "node-wait-timeout", "round-timeout"}
)  # fmt: skip


def app_run_config(app: Path | None) -> dict[str, Any]:
    """Return the run config ``app`` declares (pyproject's ``[tool.flwr.app.config]``).

    Flower gives a run these values under the suite's overrides. Nested
    tables become dotted keys, as Flower flattens them; {} when there is no
    readable pyproject.toml (then the library's defaults stand in).
    """
    import tomllib

    if app is None:
        return {}
    try:
        table = tomllib.loads((app / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    config = table.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(f"{prefix}{key}.", value)
            else:
                flat[prefix + key] = value

    walk("", config if isinstance(config, Mapping) else {})
    return flat


def config_changes(
    recorded: Mapping[str, Any],
    overrides: Mapping[str, Any],
    app_config: Mapping[str, Any] | None = None,
) -> list[str]:
    """List what differs between a results.json's ``config`` and a cell's now.

    The cell's config is ``overrides`` over the app's declared run config
    (``app_config``, :func:`app_run_config`), resolved as the ServerApp
    resolves them (every default filled in), so a default changed since the
    results were made counts, e.g. ``max-contribution-ratio: absent -> 2.0``.
    Keys of :data:`PLACEMENT_KEYS` are left out. Empty: the same run, or a
    config this version cannot resolve (an app with keys of its own): such
    results cannot be compared and stand, as before this check existed.
    """
    try:
        resolved = validate_run_config({**(app_config or {}), **overrides})
    except (ConfigError, ValueError, TypeError):
        return []
    # the JSON round trip makes tuples lists, as in the recorded file
    now = json.loads(json.dumps(dict(resolved), default=str))
    absent = object()
    changes = []
    for key in sorted((set(recorded) | set(now)) - PLACEMENT_KEYS):
        then, wanted = recorded.get(key, absent), now.get(key, absent)
        if then != wanted:
            shown = ["absent" if v is absent else repr(v) for v in (then, wanted)]
            changes.append(f"{key}: {shown[0]} -> {shown[1]}")
    return changes


def cell_done(
    results: Path,
    rounds: int,
    overrides: Mapping[str, Any] | None = None,
    app_config: Mapping[str, Any] | None = None,
) -> bool:
    """Whether a cell's results.json says it completed all its rounds.

    With ``overrides`` (the cell's run config, over the app's declared
    ``app_config``), also that it was made with that config
    (:func:`stale_reason`).
    """
    try:
        data = json.loads(results.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if data.get("status") != "completed" or len(data.get("rounds", [])) != rounds:
        return False
    return overrides is None or stale_reason(data, overrides, app_config) is None


def stale_reason(
    data: Mapping[str, Any],
    overrides: Mapping[str, Any],
    app_config: Mapping[str, Any] | None = None,
) -> str | None:
    """Say why a results.json (``data``) is not the cell ``overrides`` asks for.

    None when it is. A file without a recorded ``config`` (made by hand, or
    before results.json had one) cannot be compared and counts as current.
    """
    recorded = data.get("config")
    if not isinstance(recorded, Mapping):
        return None
    changes = config_changes(recorded, overrides, app_config)
    if not changes:
        return None
    shown = "; ".join(changes[:3]) + (
        f"; {len(changes) - 3} more" if changes[3:] else ""
    )
    return f"made with another config ({shown})"


def run_suite(
    suite: Suite,
    output_root: Path,
    app: Path,
    federation_config: str = "",
    parallel: int | None = None,
    ray_address: str | None = None,
) -> int:
    """Run every unfinished cell; return the number of failed cells.

    Ray's start-up is paid once per suite, not once per cell: the cells run
    on the cluster at ``ray_address`` one after another (it is never
    stopped here), or else on private clusters started for the suite and
    stopped at its end — one per *slot*, each slot running its share of the
    cells in turn (:mod:`fedadapt.tools.deploy.ray_cluster` says why one cell
    at a time per cluster). ``parallel`` bounds the slots (None: one per four
    cores, at most four; each slot gets its share of the CPUs). A slot's
    next cell is submitted as soon as its previous cell's results.json says
    it ended, while Flower's process of that cell still shuts down (2–4 s
    on 2 cores, which the next cell's submission and start-up overlap;
    its new Ray actors take the CPUs the old ones free).

    ``federation_config`` is passed to every ``flwr run`` (its
    ``--federation-config``), e.g. ``"client-resources-num-gpus=0.25"`` so
    that four simulated clients share each GPU; without it Ray gives the
    clients no GPU and they train on the CPU. A client reserves one CPU
    unless it says otherwise (:data:`~fedadapt.tools.deploy.ray_cluster.
    SUITE_CLIENT_CPUS`: one-thread actors side by side, not Flower's two
    threads per client). ``init-args-num-cpus`` /
    ``-num-gpus`` size the private clusters together (refused with
    ``ray_address``). Seeded cells give the same numbers whatever runs
    beside them.
    """
    import contextlib
    import queue
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    from fedadapt.tools.deploy import ray_cluster
    from fedadapt.tools.submission import (
        Cancelled,
        SimulationSuperLink,
        Submitted,
        settle_run,
        submit_run,
    )

    out = (output_root / suite.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cells = suite.cells(out)
    declared = app_run_config(app)
    todo = [
        c
        for c in cells
        if not cell_done(
            out / c.run_name / "results.json", suite.rounds, c.overrides, declared
        )
    ]
    for cell in todo:  # a completed cell is redone only for a stated reason
        entry = failed_cell(cell, out / cell.run_name, suite.rounds, declared)
        if entry["status"] == "stale":
            print(f"{cell.run_name}: redone, {entry['error']}", flush=True)
    print(
        f"{suite.name}: {len(cells)} cells, {len(cells) - len(todo)} already done; "
        f"Flower's logs in {out / '.flwr'}",
        flush=True,
    )
    failed = 0
    if not todo:
        return 0
    federation_config = ray_cluster.suite_federation_config(federation_config)
    client = ray_cluster.client_resources(federation_config)
    init = ray_cluster.parse_federation_config(federation_config)
    sized = {
        k: float(init[k])
        for k in (ray_cluster.INIT_CPUS, ray_cluster.INIT_GPUS)
        if k in init
    }
    if ray_address and sized:
        raise ValueError(
            "init-args-num-cpus / init-args-num-gpus size private clusters; "
            f"the cluster at {ray_address} has the resources `ray start` gave it"
        )
    if ray_address:
        slots = 1  # one cluster: one cell at a time (Flower sizes a run's pool to it)
        if parallel is not None and parallel > 1:
            print(
                f"fedadapt-exp: --parallel {parallel} ignored with --ray-address: "
                "cells run one at a time on one cluster (docs/ray-cluster.md)",
                file=sys.stderr,
            )
    else:
        cpus = sized.get(ray_cluster.INIT_CPUS, float(os.cpu_count() or 1))
        gpus = sized.get(ray_cluster.INIT_GPUS, float(_visible_gpus()))
        slots = ray_cluster.suite_slots(parallel, len(todo), cpus, gpus, client)
    cell_config = ray_cluster.slot_federation_config(federation_config, slots)
    cancel = threading.Event()
    tracks: dict[str, Submitted] = {}
    finished: set[str] = set()
    unsettled: dict[str, tuple[str, str]] = {}  # cell: (status, reason)
    bar = tqdm(total=len(todo), desc=suite.name, unit="cell", file=sys.stdout)
    free: queue.SimpleQueue[SimulationSuperLink] = queue.SimpleQueue()
    # twice the slots: a cell whose ServerApp has ended gives its slot to the
    # next cell while its thread waits for Flower to report it finished
    pool = ThreadPoolExecutor(max_workers=2 * slots)

    def run(cell: Cell) -> tuple[Cell, Any]:
        if cancel.is_set():  # a stop arrived before this cell started
            raise Cancelled(cell.run_name)
        # a cell not done replaces its failed or stopped attempt in its folder
        # (a live one is still refused: docs/failures.md)
        overrides = {**cell.overrides, "overwrite": True}
        track = tracks.setdefault(cell.run_name, Submitted())
        superlink = free.get()  # a slot
        released = threading.Event()

        def release() -> None:  # once: when results.json ends, or on the way out
            if not released.is_set():
                released.set()
                free.put(superlink)

        try:
            return cell, submit_run(
                superlink,
                app,
                overrides,
                suite.num_supernodes,
                suite.timeout,
                federation_config=cell_config,
                track=track,
                cancel=cancel,
                on_ended=release,
            )
        finally:
            release()

    try:
        # leaving the block stops every SuperLink (and the simulations they
        # started), then every cluster started here
        with contextlib.ExitStack() as stack:
            for slot in range(slots):
                address = ray_address
                if address is None:
                    address = stack.enter_context(
                        ray_cluster.PrivateRayCluster(
                            out / ".flwr",
                            num_cpus=float(int(cpus // slots)),
                            num_gpus=sized.get(ray_cluster.INIT_GPUS),
                            name=f"ray-slot-{slot}",
                            host=f"127.0.0.{2 + slot}",
                            worker_ports=(
                                ray_cluster.worker_port_ranges(slots)[slot]
                                if slots > 1
                                else None
                            ),
                        )
                    ).address
                # each slot's SuperLink its own FLWR_HOME: the connection in
                # its config.toml names that SuperLink (one shared file would
                # send every status query to the last one started)
                home = out / ".flwr" if slots == 1 else out / ".flwr" / f"slot-{slot}"
                free.put(
                    stack.enter_context(SimulationSuperLink(home, ray_address=address))
                )
            where = (
                f"the Ray cluster at {ray_address}"
                if ray_address
                else f"{slots} Ray cluster(s) started for this suite, "
                f"{int(cpus // slots)} CPUs each"
            )
            tqdm.write(f"{suite.name}: {slots} cell(s) at once on {where}")
            try:
                for future in as_completed([pool.submit(run, c) for c in todo]):
                    cell, outcome = future.result()
                    finished.add(cell.run_name)
                    bar.update()
                    bar.set_postfix_str(f"{cell.method} {cell.point_label} done")
                    if not outcome.ok:
                        failed += 1
                        unsettled[cell.run_name] = _settle_reason(outcome, suite)
                        tqdm.write(failure_line(cell, outcome))
            finally:
                # on any way out (Ctrl-C, SIGTERM, an error): start no further
                # cell and end the waits
                cancel.set()
                pool.shutdown(wait=False, cancel_futures=True)
    except BaseException as error:
        pool.shutdown(wait=True)  # the waits end within one poll
        reason = _stop_reason(error)
        for name, track in tracks.items():
            if name not in finished:
                settle_run(track, "stopped", reason)
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
    # every process of the suite has ended: a failed cell whose ServerApp
    # still held its folder when Flower reported it (results.json "running")
    # is marked now, with the error from Flower's log
    for name, (status, reason) in unsettled.items():
        settle_run(tracks[name], status, reason, wait=0.0)
    return failed


def failure_line(cell: Cell, outcome: RunOutcome) -> str:
    """Return the console line of a cell that did not complete.

    Names the real error from Flower's log when there is one (not Flower's
    "An error was encountered. Ending simulation."), else Flower's status
    details, and where Flower's log of the run was saved.
    """
    line = f"FAILED {cell.run_name}: {outcome.status}"
    if outcome.error:
        line += f": {outcome.error}"
    elif outcome.details:
        line += f" {outcome.details}"
    if outcome.problems:
        line += f" {outcome.problems}"
    if outcome.log is not None:
        line += f"\n  Flower's log: {outcome.log}"
    return line


def _settle_reason(outcome: RunOutcome, suite: Suite) -> tuple[str, str]:
    """How results.json of a cell that did not complete ends: (status, reason)."""
    if outcome.status == "timed-out":
        return "stopped", f"timed out after {suite.timeout:g}s (the suite's timeout)"
    return "failed", outcome.error or f"Flower: {outcome.status} {outcome.details}"


# --- reporting -----------------------------------------------------------------


def _phase_key(metric: str) -> tuple[str, str]:
    """Where results.json keeps ``metric``: (round entry key, metric key)."""
    if metric.startswith("train-"):
        return "train", metric
    return "eval", metric.removeprefix("eval-")


def _series(results: Mapping[str, Any], metric: str) -> list[tuple[int, float]]:
    phase, key = _phase_key(metric)
    points = []
    for entry in results.get("rounds", []):
        values = entry.get(phase) or {}
        if key in values and values[key] is not None:
            points.append((entry["round"], float(values[key])))
    return points


def time_to_target(
    results: Mapping[str, Any], target: Target
) -> tuple[int, float] | None:
    """Return (first round whose metric meets ``target``, wall seconds to it).

    Seconds are the sum of the rounds' ``wall_time_s`` up to that round
    (training, screening, central evaluation). An initial model that meets
    it already counts as round 0. None: never reached.
    """
    phase, key = _phase_key(target.metric)
    initial = (results.get("initial") or {}).get(phase) or {}
    if phase == "eval" and initial.get(key) is not None:
        if target.reached(float(initial[key])):
            return 0, 0.0
    elapsed = 0.0
    for entry in results.get("rounds", []):
        elapsed += float(entry.get("wall_time_s") or 0.0)
        value = (entry.get(phase) or {}).get(key)
        if value is not None and target.reached(float(value)):
            return int(entry["round"]), elapsed
    return None


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return mean, math.sqrt(var)


def _num(value: float) -> str:
    """Format a number the one way the report does: 4 significant digits."""
    return f"{value:.4g}"


def spread(values: Sequence[float]) -> str:
    """``mean ± std`` over two or more values; one value alone as itself."""
    if len(values) == 1:
        return _num(values[0])
    mean, std = _mean_std(values)
    return f"{_num(mean)} ± {_num(std)}"


def _reached(values: Sequence[float | None], suffix: str = "") -> str:
    """Spread of the seeds that reached the target; "not reached" if none did."""
    got = [v for v in values if v is not None]
    if not got:
        return "not reached"
    text = spread(got) + suffix
    if len(got) < len(values):
        text += f" ({len(got)}/{len(values)} seeds)"
    return text


def _speedups(
    mine: Sequence[tuple[int, float] | None],
    theirs: Sequence[tuple[int, float] | None],
    index: int,
) -> list[float | None]:
    """Per seed: baseline's rounds (0) or seconds (1) over the method's.

    Seeds pair up (same partition and initial model); a seed where either
    did not reach the target, or the method reached it at round 0, has None.
    """
    return [
        a[index] / b[index] if a is not None and b is not None and b[index] else None
        for a, b in zip(theirs, mine, strict=True)
    ]


def summarise(
    suite: Suite, output_root: Path, app: Path | None = None
) -> dict[str, Any]:
    """Per method: every grid point's final metric over seeds, and the best.

    A cell made with another config than the cell's now over ``app``'s
    declared run config is listed as ``stale``, not summarised.
    """
    out = output_root / suite.name
    declared = app_run_config(app)
    better = min if METRICS[suite.metric] == "min" else max
    methods: dict[str, Any] = {}
    failed: list[dict[str, Any]] = []
    for cell in suite.cells(out):
        path = out / cell.run_name / "results.json"
        if not cell_done(path, suite.rounds, cell.overrides, declared):
            failed.append(failed_cell(cell, path.parent, suite.rounds, declared))
            continue
        results = json.loads(path.read_text())
        series = _series(results, suite.metric)
        if not series:
            entry = failed_cell(cell, path.parent, suite.rounds)
            failed.append({**entry, "error": f"no {suite.metric} recorded"})
            continue
        point = methods.setdefault(cell.method, {}).setdefault(
            cell.point_label,
            {"final": [], "curves": [], "seeds": [], "to_target": [], "panels": {}},
        )
        tail = [value for _, value in series[-suite.last :]]
        point["final"].append(sum(tail) / len(tail))
        point["curves"].append(series)
        point["seeds"].append(cell.seed)
        for metric in _panel_metrics(suite):
            point["panels"].setdefault(metric, []).append(_series(results, metric))
        if suite.target is not None:
            point["to_target"].append(time_to_target(results, suite.target))
    summary: dict[str, Any] = {
        "suite": suite.name,
        "metric": suite.metric,
        "target": None if suite.target is None else dataclasses.asdict(suite.target),
        "baseline": suite.baseline,
        "methods": {},
        "failed_cells": failed,
    }
    for method, points in methods.items():
        stats = {
            label: {
                "mean": _mean_std(p["final"])[0],
                "std": _mean_std(p["final"])[1] if len(p["final"]) > 1 else None,
                "seeds": len(p["final"]),
                "seed_list": p["seeds"],
                "curves": p["curves"],
                "panels": p["panels"],
                "to_target": p["to_target"],
            }
            for label, p in points.items()
        }
        best = better(stats, key=lambda label: stats[label]["mean"])
        summary["methods"][method] = {"best": best, "points": stats}
    if suite.target is not None:
        for info in summary["methods"].values():
            info["target"] = _target_summary(info, summary["methods"], suite.baseline)
    summary["claims"] = [check_claim(c, summary, suite.metric) for c in suite.claims]
    return summary


def failed_cell(
    cell: Cell,
    run_dir: Path,
    rounds: int,
    app_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Describe a cell that did not complete: its status and why.

    ``status`` is results.json's (``failed``, ``stopped``; ``unfinished``
    for a run still marked ``running``, or ``completed`` with fewer rounds
    than the suite's; ``stale`` for one completed with another config than
    the cell's now, :func:`stale_reason`) or ``missing`` (no readable
    results.json); ``error``
    is results.json's, or for a cell without one the error in the Flower
    log saved in its folder (``flower.log``).
    """
    from fedadapt.server.run_folder import FLOWER_LOG_FILE
    from fedadapt.tools.flower_log import real_error

    entry: dict[str, Any] = {
        "cell": cell.run_name,
        "method": cell.method,
        "point": cell.point_label,
        "seed": cell.seed,
    }
    try:
        data = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        error = "no results.json (not run yet, or it failed before writing one)"
        try:
            error = real_error((run_dir / FLOWER_LOG_FILE).read_text()) or error
        except OSError:
            pass
        return {**entry, "status": "missing", "rounds": 0, "error": error}
    status = data.get("status", "?")
    done = len(data.get("rounds", []))
    error = data.get("error") or ""
    if status == "running":
        status = "unfinished"
        error = error or "results.json still says running: it is running or died"
    elif status == "completed" and done != rounds:
        status = "unfinished"
        error = error or f"completed {done} of {rounds} rounds"
    elif status == "completed" and (
        stale := stale_reason(data, cell.overrides, app_config)
    ):
        status, error = "stale", stale
    return {**entry, "status": status, "rounds": done, "error": error}


def _md(text: str) -> str:
    """``text`` as one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _panel_metrics(suite: Suite) -> list[str]:
    """Metrics plotted in report.png: loss, accuracy, the suite's and the target's."""
    extra = [suite.metric] + ([suite.target.metric] if suite.target else [])
    return list(dict.fromkeys([*PANELS, *extra]))


def _target_summary(
    info: Mapping[str, Any], methods: Mapping[str, Any], baseline: str | None
) -> dict[str, Any]:
    """Rounds/seconds to the target of a method's best point, and its speed-up.

    The speed-up pairs each seed with the baseline's best point of the same
    seed (baseline rounds / the method's rounds; > 1: faster); None without
    a baseline or when no seed pair reached the target.
    """
    best = info["points"][info["best"]]
    to_target = best["to_target"]
    result: dict[str, Any] = {
        "seeds": best["seed_list"],
        "rounds": [None if t is None else t[0] for t in to_target],
        "seconds": [None if t is None else t[1] for t in to_target],
        "speedup_rounds": None,
        "speedup_seconds": None,
    }
    if baseline is None or baseline not in methods:
        return result
    other = methods[baseline]["points"][methods[baseline]["best"]]
    theirs = dict(zip(other["seed_list"], other["to_target"], strict=True))
    paired = [s for s in best["seed_list"] if s in theirs]
    mine_by_seed = dict(zip(best["seed_list"], to_target, strict=True))
    mine = [mine_by_seed[s] for s in paired]
    base = [theirs[s] for s in paired]
    result["baseline_reached"] = any(t is not None for t in base)
    result["speedup_rounds"] = _speedups(mine, base, 0)
    result["speedup_seconds"] = _speedups(mine, base, 1)
    return result


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
            f"{claim['method']} {_num(mine)} vs {other} {_num(theirs)}"
        )
        if not ok and result["status"] == "holds":
            result["status"] = "fails"
    if result["status"] == "fails" and claim.get("known-deviation"):
        result["status"] = "fails (known deviation)"
    return result


def _table(suite: Suite, summary: Mapping[str, Any]) -> list[str]:
    """Return the table: final metric; with a target rounds/time/speed-up."""
    target, baseline = suite.target, suite.baseline
    head = ["method", "best grid point", f"final {suite.metric}"]
    if target is not None:
        head += [f"rounds to {target.label}", "time to target (s)"]
        if baseline is not None:
            head += [f"speed-up vs {baseline} (rounds)", "speed-up (time)"]
    head.append("seeds")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    failed: dict[str, int] = {}
    for entry in summary.get("failed_cells", []):
        failed[entry["method"]] = failed.get(entry["method"], 0) + 1
    for method in dict.fromkeys([*suite.methods, *summary["methods"]]):
        info = summary["methods"].get(method)
        if info is None:
            if failed.get(method):  # not one cell completed: a row that says so
                row = [method, "—", "failed", *["—"] * (len(head) - 4)]
                row.append(f"0 ({failed[method]} failed)")
                lines.append("| " + " | ".join(row) + " |")
            continue
        best = info["points"][info["best"]]
        final = _num(best["mean"])
        if best["std"] is not None:
            final += f" ± {_num(best['std'])}"
        row = [method, info["best"], final]
        if target is not None:
            reach = info["target"]
            row += [_reached(reach["rounds"]), _reached(reach["seconds"])]
            if baseline is not None:
                for key in ("speedup_rounds", "speedup_seconds"):
                    ratios = reach[key]
                    if method == baseline:
                        row.append("1 (baseline)")
                    elif baseline not in summary["methods"]:
                        row.append("baseline not run")
                    elif not reach["baseline_reached"]:
                        row.append("baseline not reached")
                    else:
                        row.append(_reached(ratios, "×"))
        seeds = str(best["seeds"])
        if failed.get(method):
            seeds += f" ({failed[method]} failed)"
        row.append(seeds)
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _failed_section(summary: Mapping[str, Any], cells: int) -> list[str]:
    """Return the report's list of the cells that did not complete (or none)."""
    failed = summary.get("failed_cells", [])
    if not failed:
        return []
    lines = [
        "",
        "## Failed cells",
        "",
        f"{len(failed)} of {cells} cells did not complete (or, `stale`, completed "
        "with another config than the suite's now) and are left out of the "
        "numbers above; `fedadapt-exp run` reruns them (Flower's log of a "
        "failed run: `flower.log` in its folder).",
        "",
        "| cell | status | error |",
        "|---|---|---|",
    ]
    for entry in failed:
        status = entry["status"]
        if status != "failed":
            status = f"failed ({status})"
        lines.append(f"| {entry['cell']} | {status} | {_md(entry['error'])} |")
    return lines


def _mean_curve(
    curves: Sequence[Sequence[tuple[int, float]]],
) -> tuple[list[int], list[float], list[float] | None]:
    """Return rounds in every seed's curve, the mean, (≥ 2 seeds) the std."""
    common = sorted(set.intersection(*(set(r for r, _ in c) for c in curves)))
    by_seed = [dict(c) for c in curves]
    columns = [[values[r] for values in by_seed] for r in common]
    means = [_mean_std(col)[0] for col in columns]
    stds = [_mean_std(col)[1] for col in columns] if len(curves) > 1 else None
    return common, means, stds


def plot_report(suite: Suite, summary: Mapping[str, Any], path: Path) -> None:
    """Plot each method's best point: loss and accuracy panels (+ the suite's).

    Mean over seeds with a ± std band when there are two or more; the
    target as a dashed line; rounds on an integer axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [
        m
        for m in _panel_metrics(suite)
        if any(
            any(info["points"][info["best"]]["panels"].get(m, []))
            for info in summary["methods"].values()
        )
    ] or [suite.metric]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, metric in zip(axes, panels, strict=True):
        for method, info in summary["methods"].items():
            curves = [c for c in info["points"][info["best"]]["panels"][metric] if c]
            if not curves:
                continue
            rounds, mean, std = _mean_curve(curves)
            (line,) = ax.plot(rounds, mean, label=f"{method} ({info['best']})")
            if std is not None:
                low = [m - s for m, s in zip(mean, std, strict=True)]
                high = [m + s for m, s in zip(mean, std, strict=True)]
                ax.fill_between(rounds, low, high, color=line.get_color(), alpha=0.2)
        if suite.target is not None and suite.target.metric == metric:
            ax.axhline(suite.target.value, color="black", linestyle="--", lw=1)
        ax.set_xlabel("round")
        ax.set_ylabel(metric)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        values = [y for line in ax.lines for y in line.get_ydata()]
        if METRICS.get(metric) == "min" and values and min(values) > 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if axes[0].lines:  # no method completed a cell: nothing to name
        axes[0].legend(fontsize=7)
    seeds = len(suite.seeds)
    fig.suptitle(
        f"{suite.name}: best grid point per method, "
        + (f"mean ± std over {seeds} seeds" if seeds > 1 else "one seed")
    )
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def write_report(
    suite: Suite, output_root: Path, app: Path | None = None
) -> dict[str, Any]:
    """Write report.md, report.json and report.png; return the summary.

    ``app``: the app the cells ran (its declared run config, :func:`summarise`).
    """
    out = output_root / suite.name
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(suite, output_root, app)
    spread_text = (
        f"mean ± std over seeds {suite.seeds}"
        if len(suite.seeds) > 1
        else f"seed {suite.seeds[0]}"
    )
    lines = [
        f"# {suite.name}",
        "",
        suite.description,
        "",
        f"Final {suite.metric} after {suite.rounds} rounds (mean of the last "
        f"{suite.last} evaluations), {spread_text}; for grids, the best grid "
        "point per method.",
    ]
    if suite.target is not None:
        lines.append(
            f"Rounds and wall time to the first evaluation with "
            f"{suite.target.label}, over the seeds that reached it; "
            '"not reached": no seed did.'
            + (
                f" Speed-up: {suite.baseline}'s rounds (time) over the method's, "
                "per seed, then over seeds."
                if suite.baseline
                else ""
            )
        )
    lines += ["", *_table(suite, summary)]
    lines += _failed_section(summary, len(suite.cells(out)))
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
    plot_report(suite, summary, out / "report.png")
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    slim = json.loads(json.dumps(summary))
    for info in slim["methods"].values():
        for point in info["points"].values():
            point.pop("curves")
            point.pop("panels")
    atomic_write_text(out / "report.json", json.dumps(slim, indent=2))
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
        "GPU machine (without it the simulated clients get no GPU); each client "
        "reserves one CPU unless this says otherwise (Flower's default is 2)",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        metavar="N",
        help="run at most N cells at once, each on its own private Ray cluster "
        "with its share of the cores (default: one per four cores, at most four)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="run the cells on this running Ray cluster (left running); default: "
        "start one private cluster for the whole suite and stop it at the end "
        "(docs/ray-cluster.md)",
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
    parser.add_argument(
        "--target",
        default=None,
        metavar="METRIC=VALUE",
        help="report rounds and wall time to reach it, e.g. accuracy=0.9 "
        "(overrides the suite's target)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="METHOD",
        help="report the speed-up to the target against this method",
    )
    args = parser.parse_args(argv)
    try:
        suite = load_suite(args.suite, parse_settings(args.set))
        suite = select(suite, args.methods, args.seeds)
        suite = report_options(suite, args.target, args.baseline)
    except (SuiteError, ConfigError, yaml.YAMLError, OSError) as error:
        print(f"fedadapt-exp: {error}", file=sys.stderr)
        return 2
    output = args.output.resolve()
    if args.command == "validate":
        print(f"{suite.name}: {len(suite.cells(output))} cells, valid")
        return 0
    if args.command == "run":
        from fedadapt.tools.submission import Terminated, raise_on_termination

        raise_on_termination()  # SIGTERM/SIGHUP stop the suite like Ctrl-C
        started = time.monotonic()
        try:
            failed = run_suite(
                suite,
                output,
                args.app.resolve(),
                args.federation_config,
                args.parallel,
                args.ray_address,
            )
        # flwr refused the run (e.g. a bad setting), Ray could not start or be
        # reached, or the federation config does not parse
        except (RuntimeError, ValueError) as error:
            print(f"fedadapt-exp: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(
                "fedadapt-exp: interrupted; no further cell started, every "
                "process started was stopped",
                file=sys.stderr,
            )
            return 130
        except Terminated as stop:
            print(
                f"fedadapt-exp: {stop.reason}; no further cell started, every "
                "process started was stopped",
                file=sys.stderr,
            )
            return int(stop.code or 1)
        print(
            f"{suite.name}: finished in {time.monotonic() - started:.0f}s, "
            f"{failed} failed"
        )
        if failed:
            return 1
    summary = write_report(suite, output, args.app.resolve())
    print((output / suite.name / "report.md").read_text())
    print(f"plot: {output / suite.name / 'report.png'}")
    if args.check and any(
        c["status"] in ("fails", "missing") for c in summary["claims"]
    ):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
