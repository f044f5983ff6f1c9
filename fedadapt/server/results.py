"""Run results: ``results.json`` (rewritten after every round) and ``curves.png``.

Per-client records (``clients.jsonl``, ``clients.png``) are written beside
them by :mod:`fedadapt.server.client_records`; :func:`load_client_records`
reads them back.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from fedadapt._atomic import atomic_open, atomic_write_text
from fedadapt.server import client_records
from fedadapt.server.client_records import load_client_records
from fedadapt.server.run_folder import RESULTS_FILE, RunFolder
from fedadapt.server.tracking import Tracker, round_metrics

__all__ = ["RunRecorder", "load_client_records", "plot_curves"]

CURVES_FILE = "curves.png"


def run_directory(cfg: Mapping[str, Any], run_id: int) -> Path:
    """Return ``<output-dir>/<run-name>`` (created), the run's output folder."""
    name = cfg["run-name"] or "{}-{}-{}-{}".format(
        datetime.now().strftime("%Y%m%d-%H%M%S"), cfg["task"], cfg["strategy"], run_id
    )
    path = Path(cfg["output-dir"]).expanduser().resolve() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def claim_run_folder(cfg: Mapping[str, Any], run_id: int) -> RunFolder:
    """Create and lock the run's folder (see :meth:`RunFolder.claim`).

    Fails naming the folder when a live run holds it, or when it holds a run
    and neither ``overwrite`` nor ``resume-from`` allows taking it over.
    """
    return RunFolder.claim(
        run_directory(cfg, run_id), cfg["overwrite"], cfg["resume-from"]
    )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("fedadapt", "flwr", "torch", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def evaluation_sources(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Say which evaluations the run reports and on what data (results.json).

    ``central`` (each round's ``eval``): ``off`` (``evaluate-every=0``, the
    server holds no data), ``task-test-set`` or ``central-data-path`` (with
    its ``path``). ``federated`` (each round's ``federated_eval``): ``off``
    (``clients-per-eval=0``) or ``node-held-out``, each sampled node's
    held-out split (its own ``data-path``'s test split, else
    ``client-test-fraction`` of its data); the Message-API ServerApp adds
    its ``exchange`` (:meth:`RunRecorder.record_federated_exchange`).
    """
    if not cfg.get("evaluate-every", 1):
        central: dict[str, Any] = {"source": "off"}
    elif cfg.get("central-data-path"):
        central = {"source": "central-data-path", "path": cfg["central-data-path"]}
    else:
        central = {"source": "task-test-set"}
    if central["source"] != "off":
        central["every"] = cfg.get("evaluate-every", 1)
    federated: dict[str, Any] = (
        {"source": "node-held-out", "clients-per-eval": cfg["clients-per-eval"]}
        if cfg.get("clients-per-eval", 0)
        else {"source": "off"}
    )
    return {"central": central, "federated": federated}


def model_round(entry: Mapping[str, Any]) -> int:
    """Return the round of the model a round entry's ``federated_eval`` scores.

    ``model-round`` (round t − 1 when evaluation rode on round t's train
    exchange); older results.json files lack it: the entry's own round.
    """
    scores = entry.get("federated_eval") or {}
    return int(scores.get("model-round", entry["round"]))


#: stands for the rounds list while the rest of results.json is serialised
_ROUNDS_MARK = "\x00fedadapt-rounds\x00"


class StartupPhases:
    """Seconds each step of a ServerApp's start-up took (results.json ``startup``).

    ``process_to_main``: the ServerApp process's age when its ``main`` began
    (interpreter, Flower's own start, the app's imports; Linux's /proc, else
    None); then each :meth:`done` step, timed from the one before. Issue
    #39: a cell's start-up is its wall time minus its rounds, and this says
    which part of it is the ServerApp's own.
    """

    def __init__(self) -> None:
        from fedadapt.client.process_info import process_age_s

        age = process_age_s()
        self.seconds: dict[str, float | None] = {
            "process_to_main": None if age is None else round(age, 3)
        }
        self._last = time.monotonic()

    def done(self, step: str) -> None:
        """Record ``step`` as ended now."""
        now = time.monotonic()
        self.seconds[step] = round(now - self._last, 3)
        self._last = now


class RunRecorder:
    """Collects per-round records and writes them as JSON and plots."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Mapping[str, Any],
        run_id: int,
        previous: Mapping[str, Any] | None = None,
        folder: RunFolder | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        """Start a record; ``previous`` continues a checkpointed run's results.

        ``folder`` is the claimed run folder (:func:`claim_run_folder`): its
        owner is recorded and its lock released by :meth:`finish`.
        ``tracker`` (:mod:`fedadapt.server.tracking`) receives the config now
        and each round's record as results.json gets it.
        """
        self.run_dir = run_dir
        self.folder = folder
        self.tracker = tracker
        self._started = time.time()
        self._round_started = self._started
        self._round_texts: list[tuple[object, str]] = []  # see :meth:`text`
        self.data: dict[str, Any] = {
            "run_id": run_id,
            "status": "running",
            "started": datetime.now(UTC).isoformat(),
            "config": dict(cfg),
            "evaluation": evaluation_sources(cfg),
            "versions": _versions(),
            "initial": None,
            "rounds": [],
        }
        if folder is not None:  # who writes: a reader can tell when it died
            self.data["owner"] = folder.owner
        if previous is not None:
            self.data["initial"] = previous.get("initial")
            self.data["rounds"] = list(previous.get("rounds", []))
            self.data["resumed_from_round"] = len(self.data["rounds"])
        rounds = self.data["rounds"]
        last = (rounds[-1]["round"] if rounds else 0) if previous is not None else None
        source = cfg.get("resume-from") if previous is not None else None
        client_records.prepare(
            run_dir, last, Path(source).expanduser().parent if source else None
        )
        self.write()
        self._track("log_config", dict(cfg))

    def record_federated_exchange(self, exchange: str) -> None:
        """Record how federated evaluation reached the clients (when it is on).

        ``evaluation.federated.exchange``: ``with-train`` (folded into the
        train messages: round t's ``federated_eval`` scores round t − 1's
        model, ``final_federated_eval`` the final one) or ``separate`` (an
        evaluate exchange a round, scoring that round's model).
        """
        federated = self.data["evaluation"]["federated"]
        if federated["source"] != "off":
            federated["exchange"] = exchange

    def record_final_evaluation(self, report: Mapping[str, Any]) -> None:
        """Record the final model's federated evaluation (a with-train run).

        ``final_federated_eval`` (metrics and ``model-round``, the last
        round) and ``final_evaluate_replies`` (reply counts) of the one
        evaluate exchange after the last round; tracked as
        ``final_federated_eval/*`` at that round.
        """
        scores = report.get("federated_eval")
        self.data["final_federated_eval"] = scores
        self.data["final_evaluate_replies"] = report.get("evaluate_replies")
        self.write()
        if scores:
            step = int(scores["model-round"])
            group = "final_federated_eval"
            self._track("log_round", step, round_metrics({group: scores}, (group,)))

    def record_startup(self, seconds: Mapping[str, float | None]) -> None:
        """Record the ServerApp's start-up steps (:class:`StartupPhases`)."""
        self.data["startup"] = dict(seconds)
        self.write()

    def record_initial(self, evaluation: Mapping[str, float] | None) -> None:
        """Record the central evaluation of the initial model (round 0)."""
        self.data["initial"] = {"eval": dict(evaluation) if evaluation else None}
        self._round_started = time.time()
        self.write()
        if evaluation:
            self._track("log_round", 0, round_metrics({"eval": evaluation}))

    def record_round(
        self,
        server_round: int,
        num_rounds: int,
        evaluation: Mapping[str, float] | None,
        report: Mapping[str, Any],
        write: bool = True,
    ) -> dict[str, Any]:
        """Record one finished round, rewrite results.json and log one line.

        ``write=False`` leaves the rewrite to the caller (a checkpoint that
        amends the round and writes once).
        """
        now = time.time()
        entry = {
            "round": server_round,
            "wall_time_s": now - self._round_started,
            "train": report.get("train"),
            "eval": dict(evaluation) if evaluation else None,
            "federated_eval": report.get("federated_eval"),
            "replies": report.get("train_replies"),
            "evaluate_replies": report.get("evaluate_replies"),
            "strategy": report.get("diagnostics", {}),
            "communication": report.get("communication"),
        }
        if "nodes" in report:  # fewer nodes than wanted after node loss
            entry["nodes"] = report["nodes"]
        if "sampled" in report:  # partition-ids sampled (seeded sampling)
            entry["sampled"] = report["sampled"]
        # SecAgg+: nodes left out from now on (their own clear metrics refused
        # the round), and nodes whose local-update arrays were held to range
        for key in ("secagg_quarantined", "secagg_local_held"):
            if key in report:
                entry[key] = report[key]
        self._round_started = now
        client_records.append_round(self.run_dir, report.get("clients") or [])
        self.data["rounds"].append(entry)
        for total in ("norm_mismatches", "clipped"):  # run totals of the rounds'
            self.data[total] = sum(
                (r.get("replies") or {}).get(total, 0) for r in self.data["rounds"]
            )
        for total in ("sent_bytes", "received_bytes"):  # training traffic
            self.data[total] = sum(
                (r.get("communication") or {}).get(total, 0)
                for r in self.data["rounds"]
            )
        if write:
            self.write()
        self._track("log_round", server_round, round_metrics(entry))
        log(logging.INFO, "%s", format_round(entry, num_rounds))
        return entry

    def _track(self, method: str, *args: Any) -> None:
        """Call the tracker; its first error stops tracking, never the run."""
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as error:  # a tracker's trouble must not end training
            self.tracker = None
            self.tracking_failed(error)

    def tracking_failed(self, error: Exception) -> None:
        """Log and record (``tracker_error``) why the tracker stopped."""
        self.data["tracker_error"] = f"{type(error).__name__}: {error}"
        log(
            logging.WARNING,
            "fedadapt: tracker=%s stopped (%s); the run goes on, results.json "
            "keeps every round",
            self.data["config"].get("tracker"),
            self.data["tracker_error"],
        )
        self.write()

    def finish(self, status: str, error: str | None = None) -> None:
        """Mark the run finished, write the curves and the final JSON.

        Then the run folder is released (a reader that sees the final status
        may start the next run in it at once).
        """
        try:
            if self.data["rounds"]:
                plot_curves(self.data, self.run_dir / CURVES_FILE)
                self._plot_clients()
        finally:
            self.data["status"] = status
            self.data["wall_time_s"] = time.time() - self._started
            if error is not None:
                self.data["error"] = error
            try:
                self.write()
            finally:
                self._track("close", status)
                self.release()

    def _plot_clients(self) -> None:
        """Write clients.png from clients.jsonl (when any reply was recorded)."""
        path = self.run_dir / client_records.CLIENTS_FILE
        if not path.is_file():
            return
        records = load_client_records(self.run_dir)
        if records:
            cfg = self.data["config"]
            client_records.plot_clients(
                records,
                self.run_dir / client_records.CLIENTS_PLOT,
                f"{cfg['task']} · {cfg['strategy']} · {cfg['client-optimizer']}",
            )

    def release(self) -> None:
        """Let go of the run folder (idempotent; nothing to do without one)."""
        if self.folder is not None:
            self.folder.release()

    def write(self) -> None:
        """Write results.json atomically (readers never see half a file)."""
        atomic_write_text(self.run_dir / RESULTS_FILE, self.text())

    def text(self) -> str:
        """Return ``json.dumps(self.data, indent=2, default=str)``, incrementally.

        results.json is rewritten every round, and serialising every round
        again (Python's indenting encoder) grew to ~80 ms of CPU a round by
        round 500 of a 10-client cell (#30), as much as a tenth of the
        round. A finished round (every one but the last, which a checkpoint
        still amends) is serialised once and its text reused; the result is
        the same string.
        """
        rounds = self.data.get("rounds")
        if not isinstance(rounds, list) or not rounds:
            return json.dumps(self.data, indent=2, default=str)
        texts = []
        for i, entry in enumerate(rounds):
            cached = self._round_texts[i] if i < len(self._round_texts) else None
            if cached is not None and cached[0] is entry and i < len(rounds) - 1:
                texts.append(cached[1])
                continue
            # an entry sits two levels deep: its inner lines get 4 more spaces
            text = json.dumps(entry, indent=2, default=str).replace("\n", "\n    ")
            texts.append(text)
            del self._round_texts[i:]
            if i < len(rounds) - 1:
                self._round_texts.append((entry, text))
        listed = "[\n    " + ",\n    ".join(texts) + "\n  ]"
        head = json.dumps({**self.data, "rounds": _ROUNDS_MARK}, indent=2, default=str)
        return head.replace(json.dumps(_ROUNDS_MARK), listed, 1)


def _fmt(metrics: Mapping[str, Any] | None, loss: str, acc: str) -> str:
    if not metrics or loss not in metrics:
        return "-"
    text = f"loss {metrics[loss]:.4f}"
    if acc in metrics:
        text += f" acc {metrics[acc]:.3f}"
    return text


def format_round(entry: Mapping[str, Any], num_rounds: int) -> str:
    """Return the one-line, human-readable summary of a round."""
    replies = entry.get("replies") or {}
    return (
        f"round {entry['round']}/{num_rounds} | "
        f"train {_fmt(entry.get('train'), 'train-loss', 'train-accuracy')} | "
        f"test {_fmt(entry.get('eval'), 'loss', 'accuracy')} | "
        f"replies {replies.get('used', 0)} used, {replies.get('failed', 0)} failed, "
        f"{replies.get('rejected', 0)} rejected | {entry['wall_time_s']:.2f}s"
    )


def plot_curves(data: Mapping[str, Any], path: Path) -> None:
    """Plot loss and accuracy per round (train from clients, test central).

    Federated evaluation is plotted at the round of the model it scored
    (``model-round``), with the final model's (``final_federated_eval``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    def series(phase: str, key: str) -> tuple[list[int], list[float]]:
        points = [
            (model_round(r) if phase == "federated_eval" else r["round"], r[phase][key])
            for r in data["rounds"]
            if r.get(phase) and key in r[phase]
        ]
        if phase == "eval" and data.get("initial") and data["initial"]["eval"]:
            if key in data["initial"]["eval"]:
                points.insert(0, (0, data["initial"]["eval"][key]))
        final = data.get("final_federated_eval")
        if phase == "federated_eval" and final and key in final:
            points.append((final["model-round"], final[key]))
        return [p[0] for p in points], [p[1] for p in points]

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (train_key, test_key, label) in (
        (ax_loss, ("train-loss", "loss", "loss")),
        (ax_acc, ("train-accuracy", "accuracy", "accuracy")),
    ):
        for phase, key, name in (
            ("train", train_key, "train (clients)"),
            ("eval", test_key, "test (central)"),
            ("federated_eval", "eval-" + test_key, "test (clients)"),
        ):
            xs, ys = series(phase, key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 2.5
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    cfg = data["config"]
    fig.suptitle(
        f"{cfg['task']} · {cfg['strategy']} · {cfg['client-optimizer']} "
        f"(run {data['run_id']})"
    )
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
