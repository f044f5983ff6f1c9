"""Per-client records: ``clients.jsonl`` beside results.json, its loader and plot.

results.json keeps per round what the replies add up to; a researcher who
asks which client diverged, lied about its norm or was clipped needs each
reply. One JSON line per train reply per round, written when the round is
recorded, from the records the strategy's screening and round statistics
filled (:func:`fedadapt.strategies.screening.reply_record`): the server's
‖Δ_i‖² is the value the step used, never recomputed here.

Each line (:func:`flatten`)::

    round, node, partition, ray_node (a simulated client: the first 12 hex
    digits of the Ray node id it ran on, else null), device (where the
    client trained: "cpu" or "cuda:k"), status (used |
    rejected | failed), reason,
    num_examples, train_loss, train_accuracy, train_time_s (client wall
    seconds), local_steps, server_sq_norm, reported_sq_norm, norm_mismatch,
    clip_scale, clipped, clipped_by (norm-bound, pull-cap, or both joined
    by +), selected (Krum/multi-Krum/Bulyan kept the update),
    center_clip_scale (centered clipping's factor), trimmed_share (the
    trimmed mean: the share of its coordinates cut as extreme; honest
    clients about 2·cut/n), server_lr_without and
    step_guard (the server step without this client; whether it capped the
    round's step), a_left_out (whether the guard's A left its ‖Δ_i‖²
    out; null when A is the plain mean), consensus_cos and projected (the
    cosine of its update with the others' mean; whether its part against
    that mean was removed), influence (the influence screen's measure: by what fraction
    its presence raised the server's validation loss; null when the
    screen is off), optimizer ({"eta-mean":
    ...}: the client optimizer's opt-* statistics, e.g. Δ-SGD's step
    sizes), metrics (every
    other scalar metric the reply carried)

Crash safety: a round's lines are appended in one write, flushed and
fsync'ed; a crash mid-write can leave at most a torn last line, which
:func:`load_client_records` skips with a warning and the next run in the
folder cuts off (:func:`prepare`). A run resumed from a checkpoint of round
k keeps the lines of rounds ≤ k only, so re-run rounds are not duplicated.
"""

from __future__ import annotations

import json
import os
import statistics
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedadapt._atomic import atomic_open, atomic_write_text
from fedadapt.strategies import wire

if TYPE_CHECKING:
    import pandas as pd

CLIENTS_FILE = "clients.jsonl"
CLIENTS_PLOT = "clients.png"

#: reply metrics given a field of their own (the rest stay under ``metrics``)
_NAMED = {
    wire.NUM_EXAMPLES: "num_examples",
    "train-loss": "train_loss",
    "train-accuracy": "train_accuracy",
    wire.TRAIN_TIME_S: "train_time_s",
    wire.PROCESS_AGE_S: "process_age_s",
    "local-steps": "local_steps",
}
_OPTIMIZER_PREFIX = "opt-"


def _ray_node_hex(value: Any) -> str | None:
    """Return a reply's ``ray-node`` metric as the node id's first 12 hex digits."""
    return None if value is None else f"{int(value):012x}"


def _device_name(value: Any) -> str | None:
    """Return a reply's ``train-device`` metric as ``"cpu"`` or ``"cuda:k"``."""
    if value is None:
        return None
    return "cpu" if int(value) < 0 else f"cuda:{int(value)}"


def flatten(record: Mapping[str, Any]) -> dict[str, Any]:
    """Return a screened reply record as one clients.jsonl line (a dict)."""
    metrics = dict(record.get("metrics") or {})
    line: dict[str, Any] = {
        "round": record["round"],
        "node": record.get("node"),
        "partition": metrics.pop(wire.PARTITION_ID, None),
        "ray_node": _ray_node_hex(metrics.pop(wire.RAY_NODE, None)),
        "device": _device_name(metrics.pop(wire.TRAIN_DEVICE, None)),
        "status": record["status"],
        "reason": record.get("reason"),
    }
    for key, name in _NAMED.items():
        line[name] = metrics.pop(key, None)
    scale = record.get("clip_scale")
    line.update(
        server_sq_norm=record.get("server_sq_norm"),
        reported_sq_norm=metrics.pop(wire.UPDATE_SQ_NORM, None),
        norm_mismatch=record.get("norm_mismatch"),
        clip_scale=scale,
        clipped=scale is not None and scale < 1,
        clipped_by=record.get("clipped_by"),
        selected=record.get("selected"),
        center_clip_scale=record.get("center_clip_scale"),
        trimmed_share=record.get("trimmed_share"),
        server_lr_without=record.get("server_lr_without"),
        step_guard=record.get("step_guard"),
        a_left_out=record.get("a_left_out"),
        consensus_cos=record.get("consensus_cos"),
        projected=record.get("projected"),
        influence=record.get("influence"),
        optimizer={
            k[len(_OPTIMIZER_PREFIX) :]: metrics.pop(k)
            for k in sorted(metrics)
            if k.startswith(_OPTIMIZER_PREFIX)
        },
        metrics=metrics,
    )
    return line


def append_round(run_dir: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Append one round's records to clients.jsonl: one write, then fsync.

    A reader (or a crash) sees whole lines of earlier rounds and at most a
    torn last line of this one (see :func:`load_client_records`).
    """
    text = "".join(
        json.dumps(flatten(r), default=str, allow_nan=False) + "\n" for r in records
    )
    if not text:
        return
    with open(run_dir / CLIENTS_FILE, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Return the whole lines' records and whether a torn last line was cut."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [], False
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: a write cut short
                return records, True
            raise ValueError(
                f"{path}: line {number} is not a JSON record (the file was "
                "edited or is not a fedadapt clients.jsonl)"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}: line {number} is not a JSON object (the file was "
                "edited or is not a fedadapt clients.jsonl)"
            )
        records.append(record)
    return records, False


def prepare(
    run_dir: Path, resumed_from_round: int | None, source: Path | None = None
) -> None:
    """Make clients.jsonl continue a run: none for a new run, rounds ≤ k on resume.

    A new run (no ``resumed_from_round``) starts without the file. A run
    resumed from round k keeps the lines of rounds ≤ k (the rounds after k
    are run again) and drops a torn last line; rewritten atomically. They
    come from ``source``, the checkpoint's folder, when the run resumes into
    another folder.
    """
    path = run_dir / CLIENTS_FILE
    if resumed_from_round is None:
        path.unlink(missing_ok=True)
        return
    origin = path
    if source is not None and source.resolve() != run_dir.resolve():
        origin = source / CLIENTS_FILE
    records, torn = _read(origin)
    kept = [r for r in records if r.get("round", 0) <= resumed_from_round]
    if origin != path or torn or len(kept) != len(records):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def load_client_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Return the per-client records of a run folder (clients.jsonl), in order.

    A torn last line (the run was killed while writing) is skipped with a
    ``RuntimeWarning`` naming the file; any other malformed line raises
    ``ValueError`` naming it. A folder without the file (a run from before
    per-client records) raises ``FileNotFoundError``; where its subfolders
    hold runs (``output-dir`` is the folder above the run folders), the
    message names them.
    """
    path = Path(run_dir) / CLIENTS_FILE
    if not path.is_file():
        runs = sorted(p.parent.name for p in Path(run_dir).glob(f"*/{CLIENTS_FILE}"))
        hint = f"; run folders below it: {', '.join(runs)}" if runs else ""
        raise FileNotFoundError(
            f"{path}: no per-client records in this run folder{hint}"
        )
    records, torn = _read(path)
    if torn:
        warnings.warn(
            f"{path}: skipped a torn last line (the run stopped while writing it)",
            RuntimeWarning,
            stacklevel=2,
        )
    return records


def to_dataframe(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Return the records as a pandas DataFrame, ``optimizer``/``metrics`` flattened.

    Nested fields become columns such as ``optimizer.eta-mean``. pandas is
    optional: without it this raises ``ImportError`` saying how to install it.
    """
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            "to_dataframe needs pandas: pip install pandas "
            "(or use the list of dicts load_client_records returns)"
        ) from None
    return pd.json_normalize(list(records))


def plot_clients(records: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    """Plot each client's server-side ‖Δ_i‖² and train loss over rounds.

    One line per partition (node id where the reply named none); rounds
    with a rejected or failed reply are shaded red. ‖Δ_i‖² on a log axis
    (one diverging client spans decades), rounds on an integer axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    clients: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        who = r.get("partition")
        name = f"partition {who}" if who is not None else f"node {r.get('node')}"
        clients.setdefault(name, []).append(r)
    rejected = sorted({r["round"] for r in records if r.get("status") != "used"})
    fig, (ax_norm, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (ax_norm, "server_sq_norm", "‖Δ_i‖² (server)"),
        (ax_loss, "train_loss", "train loss (client)"),
    ):
        for name, rows in sorted(clients.items()):
            points = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3, label=name, alpha=0.8)
        for round_ in rejected:
            ax.axvline(round_, color="red", alpha=0.2, linewidth=4)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if ax_norm.lines:
        ax_norm.set_yscale("log")
    if len(clients) <= 12 and ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(fontsize="small")
    if rejected:
        title += " · red bands: rounds with rejected or failed replies"
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


#: The per-reply signals :func:`summarize_nodes` averages per node: the
#: direction in which a value points at a hostile client (``low`` for factors
#: a defence shrank a reply by and for agreement with the others, ``high``
#: for shares of rounds or coordinates a defence took from it), and the
#: largest gap an honest node showed in our measured runs, rounded up to
#: two decimals (None: not measured). The gap is a node's mean beyond the
#: other nodes' median in that direction. Measured: the app's honest runs
#: on digits-mlp (10 nodes, Dirichlet 0.5, 20 rounds, seeds 0-6) of FedAdam
#: (multi-Krum), FedExP and Fed-LAMB (centered clipping), FedAvgM (trimmed
#: mean) and FedDuAdam (the mean), and on mnist5k-cnn (10 rounds, seeds
#: 0-3, the first four): 51 runs. Fitted first on seeds 0-3 and 0-1 (28
#: runs; 0.15, 0.65, 0.38, 0.12), those maxima named an honest node in 14
#: of the 23 runs of the later seeds (stop 68): non-IID nodes differ, and
#: the node whose data differs most is discounted by every aggregator, run
#: after run (multi-Krum left one out of every round of a FedAdam run).
#: The attack suite's loud attacks (sign flips, IPM, false weights, scaled
#: copies) reach gaps of 0.85-0.95, 0.42-0.55 and 0.20-0.47 on the three
#: aggregator signals, inside or near these maxima: a gap says which node
#: the defences discount, hostile or merely different, not which is
#: hostile (docs/robustness.md, *What an operator sees*).
SIGNALS: dict[str, tuple[str, float | None]] = {
    "clip_scale": ("low", 0.28),  # the norm bound and pull cap
    "not_selected": ("high", 1.0),  # Krum / multi-Krum / Bulyan left it out
    "center_clip_scale": ("low", 0.48),  # centered clipping
    "trimmed_share": ("high", 0.23),  # the trimmed mean cut its coordinates
    "consensus_cos": ("low", None),  # the opt-in opposing projection
    "rejected": ("high", None),  # the screen's honest rejections vary widely
}


#: clients.jsonl ``status`` → the count :func:`summarize_nodes` keeps
_STATUS_COUNTS = {"used": "used", "rejected": "rejected_replies", "failed": "failed"}


def _node_values(line: Mapping[str, Any]) -> dict[str, float]:
    """Return the :data:`SIGNALS` one clients.jsonl line holds."""
    values = {}
    for name in ("clip_scale", "center_clip_scale", "trimmed_share", "consensus_cos"):
        value = line.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"round {line.get('round')}, node {line.get('node')}: {name} is "
                f"not a number: {value!r}"
            )
        values[name] = float(value)
    if line.get("selected") is not None:
        values["not_selected"] = 0.0 if line["selected"] else 1.0
    if line.get("status") in ("used", "rejected"):
        values["rejected"] = float(line["status"] == "rejected")
    return values


def summarize_nodes(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per node of a run's clients.jsonl lines: what the defences did to it.

    For each node (in order of first appearance): its partition, its
    replies by status, the mean over its replies of each of
    :data:`SIGNALS` the run recorded (None where none was), ``gaps``: per
    signal, how far that mean lies beyond the other nodes' median in the
    direction that points at a hostile client, and ``beyond_honest``: the
    signals whose gap exceeds the largest an honest node showed in our
    measured runs.

    A way to see an attack, not a verdict: other data and splits give
    honest nodes other gaps, and an attack aimed at the aggregator in force
    is built not to show in its signal (docs/robustness.md, *What an
    operator sees*).
    """
    nodes: dict[str, dict[str, Any]] = {}
    values: dict[str, dict[str, list[float]]] = {}
    for line in lines:
        node = str(line.get("node"))
        entry = nodes.setdefault(node, {
            "node": node, "partition": line.get("partition"), "replies": 0,
            "used": 0, "rejected_replies": 0, "failed": 0,
        })  # fmt: skip
        entry["replies"] += 1
        counted = _STATUS_COUNTS.get(str(line.get("status")))
        if counted is not None:
            entry[counted] += 1
        for name, value in _node_values(line).items():
            values.setdefault(node, {}).setdefault(name, []).append(value)
    for node, entry in nodes.items():
        for name in SIGNALS:
            seen = values.get(node, {}).get(name)
            entry[name] = None if not seen else sum(seen) / len(seen)
    for node, entry in nodes.items():
        others = [e for n, e in nodes.items() if n != node]
        entry["gaps"] = {}
        for name, (direction, _) in SIGNALS.items():
            gap = _gap(entry[name], [e[name] for e in others], direction)
            if gap is not None:
                entry["gaps"][name] = gap
        entry["beyond_honest"] = [
            name
            for name, gap in entry["gaps"].items()
            if SIGNALS[name][1] is not None and gap > SIGNALS[name][1]
        ]
    return list(nodes.values())


def _gap(value: float | None, others: Sequence[Any], direction: str) -> float | None:
    """How far ``value`` lies beyond the others' median, that way (None: unknown)."""
    rest = [v for v in others if v is not None]
    if value is None or not rest:
        return None
    median = statistics.median(rest)
    return value - median if direction == "high" else median - value
