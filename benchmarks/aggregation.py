"""Server aggregation benchmark: fedadapt strategies vs Flower's (issue #4).

Times ``aggregate_train`` of Flower 1.41's own ``flwr.serverapp.strategy``
FedAvg / FedAdam (and FedAdagrad / FedYogi, as like-for-like references) and
of fedadapt's FedAvg, FedAdam, FedAdagrad, FedYogi, FedExP and FedDuA on one
round of 10 client replies carrying ResNet-18 (CIFAR variant) weights: the
real ``state_dict`` names and shapes (3x3 stem conv with 64 channels, stages
[2, 2, 2, 2] of BasicBlocks, BatchNorm with weight/bias, float32
``running_mean``/``running_var`` and int64 ``num_batches_tracked`` buffers,
linear 512->10; 11,173,962 trainable parameters, 122 arrays).

FedExP and FedDuA run twice: once with clients reporting ``update-sq-norm``
in their metrics, once without. The server computes every norm either way
(issue #17); with reports it also checks them against its own.

Replies are built once, up front, as a Flower ``Message`` would hold them
(``RecordDict`` with an ``ArrayRecord`` of serialised ``flwr.app.Array`` and a
``MetricRecord``); every strategy reads the same ``Array`` objects (Flower's
with ``Array.numpy()``, a copy; fedadapt's as read-only views of the bytes).
Each measured call is ``configure_train`` (timed separately) followed by a
timed ``aggregate_train`` (wall time, and CPU time with
``time.process_time``); strategies are interleaved round-robin, one warm-up
call each, and the median of ``--repeats`` calls is reported.

Two *floors* run in the same round-robin: one pass over the replies that only
deserialises each ``Array`` once and adds it into one float32 accumulator per
array (no screening, norms, server step or serialised result), once with
``Array.numpy()`` and once with fedadapt's zero-copy ``array_view``. Every
row's time is also given as a ratio to the zero-copy floor.

Memory is measured in a separate pass with ``tracemalloc`` (which also traces
NumPy's array buffers), on a fresh instance per strategy, in the second round
(moments already allocated):

* *peak extra*: traced peak during ``aggregate_train`` minus traced memory
  right before the call;
* *kept*: what the strategy still holds after two rounds (global-array copies,
  moments, evaluation model) beyond the returned ``ArrayRecord``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/aggregation.py                  # full size
    .venv/bin/python benchmarks/aggregation.py --quick          # width 16, ~0.7 M
    .venv/bin/python benchmarks/aggregation.py --repeats 9 --json out.json

Runtime at full size is about 1 minute on 2 CPU cores (plus ~10 s setup).
For the CPU-time columns, run with ``OPENBLAS_NUM_THREADS=1`` so that NumPy
works in this one thread.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flwr  # noqa: E402
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp import strategy as flwr_strategy  # noqa: E402

from fedadapt import strategies as ours  # noqa: E402
from fedadapt.strategies.arrays import array_view  # noqa: E402
from fedadapt.strategies.core import is_batchnorm_buffer  # noqa: E402

RESNET18_TRAINABLE = 11_173_962
NORM_KEY = "update-sq-norm"
BASELINE = "flower FedAdam"
FLOOR = "floor (one pass, zero-copy)"

# --- model ---------------------------------------------------------------------


def resnet18_cifar_shapes(
    width: int = 64, num_classes: int = 10
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Return ``state_dict`` name -> (shape, dtype) of the CIFAR ResNet-18.

    Same names, order and shapes as torchvision's ``resnet18(num_classes=10)``
    with ``conv1 = Conv2d(3, 64, 3, 1, 1, bias=False)`` and no max-pool.
    """
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}

    def conv(name: str, c_out: int, c_in: int, k: int) -> None:
        shapes[f"{name}.weight"] = ((c_out, c_in, k, k), "float32")

    def bn(name: str, c: int) -> None:
        for p in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{name}.{p}"] = ((c,), "float32")
        shapes[f"{name}.num_batches_tracked"] = ((), "int64")

    conv("conv1", width, 3, 3)
    bn("bn1", width)
    c_in = width
    for stage in range(4):
        c_out = width * 2**stage
        for block in range(2):
            prefix = f"layer{stage + 1}.{block}"
            first_in = c_in if block == 0 else c_out
            conv(f"{prefix}.conv1", c_out, first_in, 3)
            bn(f"{prefix}.bn1", c_out)
            conv(f"{prefix}.conv2", c_out, c_out, 3)
            bn(f"{prefix}.bn2", c_out)
            if block == 0 and (stage > 0 or c_in != c_out):
                conv(f"{prefix}.downsample.0", c_out, c_in, 1)
                bn(f"{prefix}.downsample.1", c_out)
        c_in = c_out
    shapes["fc.weight"] = ((num_classes, c_in), "float32")
    shapes["fc.bias"] = ((num_classes,), "float32")
    return shapes


def trainable_count(shapes: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Return the number of trainable parameters (float arrays, not BN stats)."""
    return sum(
        math.prod(shape)
        for name, (shape, dtype) in shapes.items()
        if dtype.startswith("float") and not is_batchnorm_buffer(name)
    )


def initial_arrays(
    shapes: dict[str, tuple[tuple[int, ...], str]], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Return plausible global weights (BN weight 1, running_var 1, ...)."""
    out: dict[str, np.ndarray] = {}
    for name, (shape, dtype) in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if dtype == "int64":
            out[name] = np.array(1000, dtype=np.int64).reshape(shape)
        elif leaf in ("running_var",) or (leaf == "weight" and len(shape) == 1):
            out[name] = np.ones(shape, dtype=np.float32)
        elif leaf in ("bias", "running_mean"):
            out[name] = np.zeros(shape, dtype=np.float32)
        else:
            fan_in = math.prod(shape[1:])
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(
                math.sqrt(2.0 / fan_in)
            )
    return out


# --- replies -------------------------------------------------------------------


def _reply(arrays: ArrayRecord, metrics: dict[str, Any], node_id: int) -> Message:
    """A reply Message as a strategy receives it (cf. tests/helpers.py)."""
    content = RecordDict({"metrics": MetricRecord(metrics), "arrays": arrays})
    message = Mock(spec=Message)
    message.content = content
    message.has_error.return_value = False
    message.metadata.src_node_id = node_id
    return message


def make_replies(
    x0: dict[str, np.ndarray], num_clients: int, rng: np.random.Generator
) -> tuple[list[Message], list[Message]]:
    """Return (replies without, replies with ``update-sq-norm``).

    Both lists share the same serialised ``ArrayRecord`` per client; only the
    ``MetricRecord`` differs.
    """
    plain, reported = [], []
    for node in range(1, num_clients + 1):
        arrays: dict[str, np.ndarray] = {}
        sq_norm = 0.0
        for name, x in x0.items():
            if x.dtype.kind == "i":
                arrays[name] = np.asarray(x + rng.integers(50, 200), dtype=x.dtype)
                continue
            noise = rng.standard_normal(x.shape, dtype=np.float32) * np.float32(1e-2)
            arrays[name] = x + noise
            if not is_batchnorm_buffer(name):
                delta = arrays[name] - x
                sq_norm += float(np.vdot(delta, delta))
        record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        del arrays
        metrics = {"num-examples": int(rng.integers(200, 1000)), "loss": 1.0}
        plain.append(_reply(record, metrics, node))
        reported.append(_reply(record, {**metrics, NORM_KEY: sq_norm}, node))
    return plain, reported


def make_grid(num_nodes: int) -> Grid:
    """A Grid stand-in that only knows its node ids."""
    grid = Mock(spec=Grid)
    grid.get_node_ids.return_value = list(range(1, num_nodes + 1))
    return grid


def set_task_identity() -> None:
    """Messages built by configure_train need a run identity (Flower sets it)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


# --- cases ---------------------------------------------------------------------


class Case:
    """One strategy configuration: a name, a factory, which replies it gets."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], Any],
        norms: bool = False,
        counterpart: str | None = None,
    ) -> None:
        self.name = name
        self.factory = factory
        self.norms = norms
        self.counterpart = counterpart
        self.aggregate: list[float] = []
        self.aggregate_cpu: list[float] = []
        self.configure: list[float] = []
        self.memory: dict[str, float] = {}


class Floor:
    """The unavoidable work of a round: read every reply's arrays once.

    ``aggregate_train`` deserialises each ``Array`` once and adds it into one
    accumulator per key (float32 for float arrays), nothing else: no
    screening, no norms, no server step, no serialised result. ``decode`` is
    ``Array.numpy()`` (a copy, as Flower's strategies read replies) or
    fedadapt's :func:`array_view` (a read-only view of the bytes).
    """

    def __init__(self, decode: Callable[[Array], np.ndarray]) -> None:
        self.decode = decode

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[None]:
        """Sample every node (nothing to configure)."""
        return [None] * len(grid.get_node_ids())

    def aggregate_train(
        self, server_round: int, replies: list[Message]
    ) -> tuple[dict[str, np.ndarray], None]:
        """Return Σ_i x_i per key, one pass over the replies."""
        records = [next(iter(m.content.array_records.values())) for m in replies]
        sums: dict[str, np.ndarray] = {}
        for key in records[0]:
            acc: np.ndarray | None = None
            for record in records:
                x = self.decode(record[key])
                if acc is None:
                    acc = np.zeros(x.shape, np.result_type(x.dtype, np.float32))
                acc += x
            sums[key] = acc  # type: ignore[assignment]
        return sums, None


def make_cases(with_references: bool) -> list[Case]:
    """All strategies, Flower's first; default arguments everywhere."""
    cases = [
        Case("floor (one pass, Array.numpy)", lambda: Floor(Array.numpy)),
        Case(FLOOR, lambda: Floor(array_view)),
        Case("flower FedAvg", flwr_strategy.FedAvg),
        Case(BASELINE, flwr_strategy.FedAdam),
    ]
    if with_references:
        cases += [
            Case("flower FedAdagrad", flwr_strategy.FedAdagrad),
            Case("flower FedYogi", flwr_strategy.FedYogi),
        ]
    cases += [
        Case("fedadapt FedAvg", ours.FedAvg, counterpart="flower FedAvg"),
        Case("fedadapt FedAdam", ours.FedAdam, counterpart=BASELINE),
        Case(
            "fedadapt FedAdagrad",
            ours.FedAdagrad,
            counterpart="flower FedAdagrad" if with_references else None,
        ),
        Case(
            "fedadapt FedYogi",
            ours.FedYogi,
            counterpart="flower FedYogi" if with_references else None,
        ),
        Case("fedadapt FedExP (norms reported)", ours.FedExP, norms=True),
        Case("fedadapt FedExP (norms recomputed)", ours.FedExP),
        Case("fedadapt FedDuA (norms reported)", ours.FedDuA, norms=True),
        Case("fedadapt FedDuA (norms recomputed)", ours.FedDuA),
    ]
    return cases


def record_bytes(record: ArrayRecord | dict[str, np.ndarray]) -> int:
    """Return the size of a result: serialised Arrays or plain NumPy arrays."""
    return sum(
        a.nbytes if isinstance(a, np.ndarray) else len(a.data) for a in record.values()
    )


def one_round(
    strategy: Any,
    server_round: int,
    global_arrays: ArrayRecord,
    replies: list[Message],
    grid: Grid,
) -> tuple[float, float, float, ArrayRecord]:
    """Run configure_train + aggregate_train; return the times and the result.

    Times: configure_train (wall), aggregate_train (wall, then CPU time of
    this process, ``time.process_time``).
    """
    start = time.perf_counter()
    messages = list(
        strategy.configure_train(server_round, global_arrays, ConfigRecord(), grid)
    )
    configured = time.perf_counter()
    if len(messages) != len(replies):
        raise RuntimeError(f"sampled {len(messages)} nodes, expected {len(replies)}")
    del messages
    gc.collect()
    start_cpu = time.process_time()
    start_aggregate = time.perf_counter()
    arrays, _ = strategy.aggregate_train(server_round, replies)
    done = time.perf_counter()
    cpu = time.process_time() - start_cpu
    if arrays is None:
        raise RuntimeError(f"{type(strategy).__name__} produced no arrays")
    return configured - start, done - start_aggregate, cpu, arrays


def measure_time(
    cases: list[Case],
    global_arrays: ArrayRecord,
    replies: dict[bool, list[Message]],
    grid: Grid,
    repeats: int,
    warmup: int,
) -> None:
    """Interleave strategies round-robin; keep times after the warm-up calls."""
    strategies = {case.name: case.factory() for case in cases}
    for i in range(warmup + repeats):
        for case in cases:
            configure, aggregate, cpu, arrays = one_round(
                strategies[case.name], i + 1, global_arrays, replies[case.norms], grid
            )
            del arrays
            if i >= warmup:
                case.configure.append(configure)
                case.aggregate.append(aggregate)
                case.aggregate_cpu.append(cpu)
        print(f"  pass {i + 1}/{warmup + repeats} done", file=sys.stderr, flush=True)
    check_reports(strategies)


def check_reports(strategies: dict[str, Any]) -> None:
    """Make sure our strategies used every reply (no silent rejections)."""
    for name, strategy in strategies.items():
        for server_round, entry in getattr(strategy, "round_reports", {}).items():
            report = entry.get("train_replies", {})
            if report.get("rejected") or report.get("failed"):
                raise RuntimeError(f"{name} round {server_round}: {report}")


def measure_memory(
    cases: list[Case],
    global_arrays: ArrayRecord,
    replies: dict[bool, list[Message]],
    grid: Grid,
) -> None:
    """Traced peak during round 2's aggregate_train; state kept after it."""
    mib = 2.0**20
    for case in cases:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        strategy = case.factory()
        *_, result = one_round(strategy, 1, global_arrays, replies[case.norms], grid)
        del result
        messages = list(
            strategy.configure_train(2, global_arrays, ConfigRecord(), grid)
        )
        del messages
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = strategy.aggregate_train(2, replies[case.norms])[0]
        peak = tracemalloc.get_traced_memory()[1]
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base - record_bytes(result)
        tracemalloc.stop()
        case.memory = {"peak_extra_mib": (peak - before) / mib, "kept_mib": kept / mib}
        del result, strategy
        print(f"  memory: {case.name} done", file=sys.stderr, flush=True)


def profile(
    cases: list[Case],
    name: str,
    global_arrays: ArrayRecord,
    replies: dict[bool, list[Message]],
    grid: Grid,
) -> int:
    """Print the top functions (by own time) of one round-2 aggregate_train."""
    import cProfile
    import pstats

    by_name = {c.name: c for c in cases}
    if name not in by_name:
        print(f"unknown strategy {name!r}; one of {sorted(by_name)}", file=sys.stderr)
        return 2
    case = by_name[name]
    strategy = case.factory()
    one_round(strategy, 1, global_arrays, replies[case.norms], grid)
    list(strategy.configure_train(2, global_arrays, ConfigRecord(), grid))
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    strategy.aggregate_train(2, replies[case.norms])
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return 0


# --- report --------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Describe where the numbers come from."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "flwr": flwr.__version__,
        "platform": platform.platform(),
        "loadavg_1_5_15": list(os.getloadavg()),
    }


def results_table(cases: list[Case]) -> tuple[str, list[dict[str, Any]]]:
    """Return a Markdown table and the rows behind it."""
    by_name = {c.name: c for c in cases}
    base = statistics.median(by_name[BASELINE].aggregate)
    floor = statistics.median(by_name[FLOOR].aggregate)
    base_cpu = statistics.median(by_name[BASELINE].aggregate_cpu)
    floor_cpu = statistics.median(by_name[FLOOR].aggregate_cpu)
    base_mem = by_name[BASELINE].memory.get("peak_extra_mib")
    rows = []
    for case in cases:
        med = statistics.median(case.aggregate)
        other = by_name.get(case.counterpart) if case.counterpart else None
        row = {
            "strategy": case.name,
            "aggregate_median_s": med,
            "aggregate_min_s": min(case.aggregate),
            "aggregate_times_s": case.aggregate,
            "configure_median_s": statistics.median(case.configure),
            "ratio_to_flower_fedadam": med / base,
            "ratio_to_floor": med / floor,
            "aggregate_cpu_median_s": statistics.median(case.aggregate_cpu),
            "aggregate_cpu_times_s": case.aggregate_cpu,
            "cpu_ratio_to_flower_fedadam": statistics.median(case.aggregate_cpu)
            / base_cpu,
            "cpu_ratio_to_floor": statistics.median(case.aggregate_cpu) / floor_cpu,
            "counterpart": case.counterpart,
            "ratio_to_counterpart": (
                med / statistics.median(other.aggregate) if other else None
            ),
            **case.memory,
        }
        if base_mem and "peak_extra_mib" in case.memory:
            row["peak_ratio_to_flower_fedadam"] = case.memory["peak_extra_mib"] / (
                base_mem
            )
        rows.append(row)
    header = (
        "| strategy | aggregate_train median (s) | min (s) | × Flower FedAdam "
        "| × floor | CPU × Flower FedAdam | CPU × floor | × Flower counterpart "
        "| configure_train (s) | peak extra (MiB) | × Flower FedAdam peak "
        "| kept state (MiB) |"
    )
    lines = [header, "|" + "---|" * 12]
    for r in rows:
        counterpart = (
            f"{r['ratio_to_counterpart']:.2f}" if r["ratio_to_counterpart"] else "—"
        )
        peak = r.get("peak_extra_mib")
        lines.append(
            f"| {r['strategy']} | {r['aggregate_median_s']:.3f} "
            f"| {r['aggregate_min_s']:.3f} | {r['ratio_to_flower_fedadam']:.2f} "
            f"| {r['ratio_to_floor']:.2f} | {r['cpu_ratio_to_flower_fedadam']:.2f} "
            f"| {r['cpu_ratio_to_floor']:.2f} | {counterpart} "
            f"| {r['configure_median_s']:.3f} "
            + (
                f"| {peak:.0f} | {r['peak_ratio_to_flower_fedadam']:.2f} "
                f"| {r['kept_mib']:.0f} |"
                if peak is not None
                else "| — | — | — |"
            )
        )
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    """Build replies, measure, print the table (and optionally write JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="width 16 instead of 64 (~0.7 M parameters) for a fast smoke run",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (>= 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first calls")
    parser.add_argument("--clients", type=int, default=10, help="replies per round")
    parser.add_argument(
        "--no-references",
        action="store_true",
        help="skip Flower's FedAdagrad/FedYogi (like-for-like references)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip tracemalloc")
    parser.add_argument(
        "--profile",
        metavar="STRATEGY",
        help="instead of the table, cProfile one round-2 aggregate_train of this "
        "strategy (a name from the table, e.g. 'fedadapt FedAdam')",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write results to this file")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.clients < 2:
        parser.error("need --repeats >= 1, --warmup >= 0, --clients >= 2")

    logging.getLogger("flwr").setLevel(logging.WARNING)
    set_task_identity()
    rng = np.random.default_rng(args.seed)
    shapes = resnet18_cifar_shapes(width=16 if args.quick else 64)
    trainable = trainable_count(shapes)
    if not args.quick and trainable != RESNET18_TRAINABLE:
        raise AssertionError(f"{trainable} trainable params, want {RESNET18_TRAINABLE}")
    total = sum(math.prod(s) for s, _ in shapes.values())

    print(
        f"ResNet-18 (CIFAR) {'quick ' if args.quick else ''}shapes: {len(shapes)} "
        f"arrays, {trainable:,} trainable params, {total:,} values incl. buffers; "
        f"{args.clients} clients, {args.warmup} warm-up + {args.repeats} timed calls",
        file=sys.stderr,
    )
    x0 = initial_arrays(shapes, rng)
    global_arrays = ArrayRecord({k: Array(v) for k, v in x0.items()})
    plain, reported = make_replies(x0, args.clients, rng)
    replies = {False: plain, True: reported}
    grid = make_grid(args.clients)

    cases = make_cases(with_references=not args.no_references)
    if args.profile:
        return profile(cases, args.profile, global_arrays, replies, grid)
    started = time.perf_counter()
    measure_time(cases, global_arrays, replies, grid, args.repeats, args.warmup)
    if not args.no_memory:
        measure_memory(cases, global_arrays, replies, grid)
    elapsed = time.perf_counter() - started

    table, rows = results_table(cases)
    print(table)
    print(f"\n(measurement time {elapsed:.0f} s)", file=sys.stderr)
    if args.json:
        payload = {
            "benchmark": "aggregate_train, ResNet-18 CIFAR state_dict",
            "machine": machine(),
            "settings": {
                "quick": args.quick,
                "arrays": len(shapes),
                "trainable_params": trainable,
                "values_incl_buffers": total,
                "clients": args.clients,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "seed": args.seed,
                "memory_method": "tracemalloc (Python + NumPy buffers), round 2",
            },
            "baseline": BASELINE,
            "results": rows,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
