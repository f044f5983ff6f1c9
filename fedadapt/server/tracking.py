"""Experiment trackers: every round's record also goes to TensorBoard, W&B or MLflow.

Opt-in with the run-config key ``tracker`` (``none`` by default). The
tracker receives exactly what results.json records per round
(:func:`round_metrics` flattens one round entry of
:class:`~fedadapt.server.results.RunRecorder` into ``group/key`` scalars), so
nothing is computed twice and simulation, deployment and ``fedadapt-exp``
log the same series. The run config is logged once at start as
hyperparameters.

Each backend is imported only when chosen and is an extra
(``pip install 'fedadapt[tensorboard]'``, ``[wandb]``, ``[mlflow]``). A
missing package fails the run at start, in one line naming the extra (our
choice: a researcher who asked for a tracker would otherwise find out after
the run that nothing was logged). Once a run trains, a tracker error (full
disk, locked database) is logged once, recorded in results.json
(``tracker_error``) and tracking stops; the run goes on.

Where: ``tracker-dir`` (empty = ``<run folder>/tracker``); runs sharing a
``tracker-group`` (``fedadapt-exp`` sets it to the suite's name) are
grouped: TensorBoard ``<tracker-dir>/<group>/<run>``, W&B ``group=<group>``,
MLflow experiment ``<group>`` (``fedadapt`` without one). The run is named
after its run folder. W&B runs offline unless ``WANDB_MODE`` says otherwise
(``wandb sync <tracker-dir>/wandb/offline-run-*`` uploads later); MLflow
writes the SQLite store ``<tracker-dir>/mlflow.db`` (MLflow's local store:
its plain-file store is deprecated and refuses to open by default).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from flwr.common.logger import log

from fedadapt.errors import ConfigError

#: tracker name -> the module it needs (the extra is named after the tracker)
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: MLflow experiment of runs without a ``tracker-group``
DEFAULT_GROUP = "fedadapt"
#: round entry fields logged as scalar groups (lists such as rejections skipped)
ROUND_GROUPS = (
    "eval",
    "federated_eval",
    "train",
    "replies",
    "evaluate_replies",
    "strategy",
    "communication",
)


class Tracker(Protocol):
    """What the run recorder needs from a tracker backend."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the run config as the run's hyperparameters (once, at start)."""

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one round's scalars at ``step`` (the round; 0 = initial model)."""

    def close(self, status: str) -> None:
        """Flush and end the run; ``status`` is results.json's final status."""


def check_tracker(cfg: Mapping[str, Any]) -> None:
    """Fail at start, naming the extra, when the chosen tracker is not installed."""
    name = cfg.get("tracker", "none")
    module = MODULES.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ConfigError(
            "tracker",
            f"tracker={name!r} needs the {module} package: "
            f"pip install 'fedadapt[{name}]'",
        )


def tracker_dir(cfg: Mapping[str, Any], run_dir: Path) -> Path:
    """Return where the tracker writes: ``tracker-dir``, or ``<run>/tracker``."""
    chosen = cfg.get("tracker-dir", "")
    return Path(chosen).expanduser().resolve() if chosen else run_dir / "tracker"


def open_tracker(cfg: Mapping[str, Any], run_dir: Path) -> Tracker | None:
    """Start the tracker ``cfg`` names for the run in ``run_dir`` (None: none)."""
    name = cfg.get("tracker", "none")
    if name == "none":
        return None
    check_tracker(cfg)
    directory = tracker_dir(cfg, run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    group = cfg.get("tracker-group", "")
    backends: dict[str, Callable[[Path, str, str], Tracker]] = {
        "tensorboard": TensorBoardTracker,
        "wandb": WandbTracker,
        "mlflow": MlflowTracker,
    }
    tracker: Tracker = backends[name](directory, group, run_dir.name)
    log(logging.INFO, "fedadapt: tracking with %s in %s", name, directory)
    return tracker


def round_metrics(
    entry: Mapping[str, Any], groups: Sequence[str] = ROUND_GROUPS
) -> dict[str, float]:
    """Flatten one results.json round entry into ``group/key`` scalars.

    Central evaluation ``eval/*``, federated evaluation ``federated_eval/*``,
    aggregated client metrics ``train/*`` (Δ-SGD's step sizes arrive there as
    ``opt-*``), reply counts ``replies/*`` and ``evaluate_replies/*``, every
    strategy diagnostic ``strategy/*`` (η_t, ‖Δ̄‖², moment norms, ...),
    traffic ``communication/*`` and ``time/round_s``. Only each group's
    numbers are taken: lists (rejections, sampled ids) and per-node tables
    (``communication.sent``) stay in results.json. ``groups``: the
    entry's fields to take (a final evaluation's own).
    """
    scalars: dict[str, float] = {}
    for group in groups:
        for key, value in (entry.get(group) or {}).items():
            if isinstance(value, bool | int | float):  # bools count as 0/1
                scalars[f"{group}/{key}"] = float(value)
    if "wall_time_s" in entry:
        scalars["time/round_s"] = float(entry["wall_time_s"])
    return scalars


def hyperparameters(config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """Return the run config as flat scalar hyperparameters (others as text)."""
    return {
        key: value if isinstance(value, bool | int | float | str) else str(value)
        for key, value in config.items()
    }


class TensorBoardTracker:
    """Event files under ``<dir>/<group>/<run>`` via torch's SummaryWriter."""

    def __init__(self, directory: Path, group: str, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = directory / group / run_name if group else directory / run_name
        self.writer = SummaryWriter(log_dir=str(self.logdir))

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Config as a text table and in the HParams dashboard."""
        from torch.utils.tensorboard.summary import hparams

        params = hyperparameters(config)
        rows = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + rows, 0)
        events = self.writer._get_file_writer()  # as SummaryWriter.add_hparams
        for summary in hparams(params, {}):  # this run, not a sub-run
            events.add_summary(summary)
        self.writer.flush()

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        """One scalar per metric; flushed so a live TensorBoard shows the round."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        """Record the final status and close the event file."""
        self.writer.add_text("status", status, 0)
        self.writer.close()


class WandbTracker:
    """A W&B run, offline by default (``WANDB_MODE``), written under ``<dir>``."""

    def __init__(self, directory: Path, group: str, run_name: str) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_GROUP),
            group=group or None,
            name=run_name,
            dir=str(directory),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the run config as W&B's run config."""
        self.run.config.update(hyperparameters(config), allow_val_change=True)

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        """One history row per round, stepped by the round."""
        self.run.log(dict(metrics), step=step)

    def close(self, status: str) -> None:
        """Finish the run: exit code 0 when it completed, 1 otherwise.

        Then W&B's service process is ended: ``finish`` returns before that
        process has written the whole offline run under load; ``teardown``
        waits for it (and a run's processes end with the run).
        """
        import wandb

        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status == "completed" else 1)
        wandb.teardown()


class MlflowTracker:
    """An MLflow run in the SQLite store ``<dir>/mlflow.db``."""

    #: MLflow's limits per log_batch call
    MAX_PARAMS, MAX_METRICS = 100, 1000

    def __init__(self, directory: Path, group: str, run_name: str) -> None:
        import fcntl

        from mlflow.tracking import MlflowClient

        experiment = group or DEFAULT_GROUP
        # parallel fedadapt-exp cells share the store: MLflow's creation of a
        # new database (and of the suite's experiment) is not safe to race
        with open(directory / "mlflow.db.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self.client = MlflowClient(tracking_uri=mlflow_uri(directory))
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(experiment)
            )
            self.run_id = self.client.create_run(
                experiment_id, run_name=run_name
            ).info.run_id
        self.pending: list[Any] = []  # MLflow's RunOperations not yet waited for

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the config as the run's params (strings, as MLflow stores them)."""
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in hyperparameters(config).items()]
        for start in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(
                self.run_id, params=params[start : start + self.MAX_PARAMS]
            )

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        """One batch per round, stepped by the round, written in the background.

        MLflow's asynchronous logging: a SQLite commit takes 10-20 ms, which
        would be several % of a fast simulated round (docs/benchmarks.md);
        :meth:`close` waits for every batch.
        """
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), self.MAX_METRICS):
            chunk = batch[start : start + self.MAX_METRICS]
            operation = self.client.log_batch(
                self.run_id, metrics=chunk, synchronous=False
            )
            if operation is not None:
                self.pending.append(operation)

    def close(self, status: str) -> None:
        """Wait for the batches, then end the run: FINISHED, KILLED or FAILED."""
        for operation in self.pending:
            operation.wait()  # raises a batch's error (recorded as tracker_error)
        self.pending.clear()
        states = {"completed": "FINISHED", "stopped": "KILLED"}
        self.client.set_terminated(self.run_id, states.get(status, "FAILED"))


def mlflow_uri(directory: Path) -> str:
    """Return the tracking URI of the MLflow store in ``directory``."""
    return f"sqlite:///{directory.resolve() / 'mlflow.db'}"
