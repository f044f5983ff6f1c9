"""Pieces of a run shared by the Message-API and the legacy ServerApp."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log
from torch.utils.data import Dataset, TensorDataset

from fedadapt._atomic import atomic_open
from fedadapt.config import ConfigError
from fedadapt.errors import PartitionQueryError
from fedadapt.registry import lookup
from fedadapt.server.checkpoint import CHECKPOINT_FILE, save_checkpoint
from fedadapt.server.results import RunRecorder, claim_run_folder
from fedadapt.server.run_folder import RunFolder, RunFolderError
from fedadapt.server.tracking import check_tracker, open_tracker
from fedadapt.strategies.adapter import FederationFailedError
from fedadapt.tasks import Task, evaluate_model, pick_device
from fedadapt.tasks.datasets import DatasetCorruptError, DatasetMissingError
from fedadapt.tasks.node_data import (
    NodeDataError,
    load_evaluation_set,
    load_validation_set,
)

EVAL_BATCH_SIZE = 512
State = dict[str, np.ndarray]
#: the model whose metrics results.json reported last, written when a run completes
FINAL_MODEL_FILE = "final_model.npz"

#: Errors whose message says everything a user needs (the key and its valid
#: values, the files to fetch, the clients' own error text): logged without
#: a traceback.
USER_ERRORS = (
    ConfigError,
    DatasetMissingError,
    DatasetCorruptError,
    FederationFailedError,
    PartitionQueryError,
    RunFolderError,
)


class OneLineUserErrors(logging.Filter):
    """Turn Flower's "ServerApp raised an exception" + traceback into one line.

    Flower logs every exception that ends a ServerApp (simulation or
    deployment) through its ``flwr`` logger with the traceback; for
    :data:`USER_ERRORS` the record keeps only the message. The run still
    ends ``finished:failed`` with the message in its status details.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite records that carry a user error; never drop a record."""
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, USER_ERRORS):
            record.msg, record.args = f"fedadapt: run failed: {error}", ()
            record.exc_info, record.exc_text = None, None
        return True


def log_user_errors_in_one_line() -> None:
    """Install :class:`OneLineUserErrors` on Flower's logger (once per process)."""
    logger = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineUserErrors) for f in logger.filters):
        logger.addFilter(OneLineUserErrors())


def check_names(cfg: Mapping[str, Any]) -> None:
    """Resolve every registry-backed key now, so a bad name fails at start.

    So is a ``tracker`` whose package is missing (one line naming the extra).
    """
    for key in ("task", "strategy", "client-optimizer", "partition"):
        lookup(key).get(cfg[key])
    check_tracker(cfg)


def initial_state(task: Task, cfg: Mapping[str, Any]) -> State:
    """Return the seeded initial model as a NumPy state dict."""
    torch.manual_seed(cfg["seed"])
    return {k: v.numpy() for k, v in task.build_model().state_dict().items()}


def check_partition(task: Task, cfg: Mapping[str, Any], num_nodes: int) -> None:
    """Fail at start when the task's data cannot feed ``num_nodes`` clients.

    Our choice, for simulations (node i is client i of ``num_nodes``, the
    server sees the same ``data-dir``): compute every client's data as the
    clients will (the partition lands in the on-disk cache they then read)
    and require at least one training sample per client, and one local test
    sample when federated evaluation is on (``clients-per-eval`` > 0). A
    scheme that cannot split the data at all (e.g. ``dirichlet``'s 10
    samples per client) says why. Raises one-line ConfigError naming
    ``num-supernodes``, ``partition`` and ``task`` and how to fix it.
    """
    needs_test = cfg["clients-per-eval"] > 0
    no_train: list[int] = []
    no_test: list[int] = []
    try:
        for pid in range(num_nodes):
            data = task.load_client(cfg, pid, num_nodes)
            if len(data.train) == 0:  # type: ignore[arg-type]
                no_train.append(pid)
            elif needs_test and len(data.test) == 0:  # type: ignore[arg-type]
                no_test.append(pid)
    except ValueError as error:
        if isinstance(error, USER_ERRORS):
            raise
        problem = str(error).rstrip(".")
    else:
        if not no_train and not no_test:
            return
        problem = (
            _clients_without(no_train, num_nodes, "training sample")
            if no_train
            else _clients_without(no_test, num_nodes, "local test sample")
            + " for federated evaluation (clients-per-eval > 0; or raise "
            "client-test-fraction, or set clients-per-eval=0)"
        )
    raise ConfigError(
        "partition",
        f"task={cfg['task']!r} split by partition={cfg['partition']!r} cannot "
        f"feed {num_nodes} simulated nodes (num-supernodes): {problem}; lower "
        "num-supernodes (fedadapt simulate --num-supernodes N, flwr run "
        "--federation-config 'num-supernodes=N') or choose another partition "
        "or a larger task",
    )


def _clients_without(pids: list[int], num_nodes: int, what: str) -> str:
    shown = ", ".join(map(str, pids[:5])) + (", ..." if len(pids) > 5 else "")
    return f"{len(pids)} of {num_nodes} clients get no {what} (partition-ids {shown})"


def _output_dir_error(cfg: Mapping[str, Any], error: OSError) -> ConfigError:
    """Name the key and the path of an ``output-dir`` that cannot be written."""
    path = Path(error.filename) if error.filename else cfg["output-dir"]
    return ConfigError(
        "output-dir",
        f"cannot write the run folder at {path} ({error.strerror or error}); "
        "set output-dir to a writable folder (an absolute path)",
    )


def claim_output_folder(cfg: Mapping[str, Any], run_id: int) -> RunFolder:
    """Create and lock the run folder (:func:`claim_run_folder`).

    An ``output-dir`` that cannot be created or written raises ConfigError
    naming the key and the path (instead of a bare PermissionError).
    """
    try:
        return claim_run_folder(cfg, run_id)
    except OSError as error:
        raise _output_dir_error(cfg, error) from None


def open_recorder(
    folder: RunFolder,
    cfg: Mapping[str, Any],
    run_id: int,
    previous: Mapping[str, Any] | None = None,
) -> RunRecorder:
    """Start results.json in the claimed run ``folder``, and its tracker.

    A folder that cannot be written raises ConfigError naming ``output-dir``.
    A tracker that cannot start (its package is checked by
    :func:`check_names`) is logged and recorded; the run goes on untracked.
    """
    tracker, failure = None, None
    try:
        tracker = open_tracker(cfg, folder.path)
    except Exception as error:  # e.g. a locked MLflow store: train anyway
        failure = error
    try:
        recorder = RunRecorder(
            folder.path, cfg, run_id, previous=previous, folder=folder, tracker=tracker
        )
    except OSError as error:
        if tracker is not None:  # no run to track: end the tracker's run too
            tracker.close("failed")
        raise _output_dir_error(cfg, error) from None
    if failure is not None:
        recorder.tracking_failed(failure)
    return recorder


def central_evaluator(
    task: Task, cfg: Mapping[str, Any]
) -> Callable[[Mapping[str, Any]], dict[str, float]] | None:
    """Return ``state dict -> metrics`` on the server's evaluation set, or None.

    None when central evaluation is off (``evaluate-every=0``): the server
    then loads no data at all (a deployment whose nodes hold all the data).
    The set is run-config ``central-data-path`` when given (read and checked
    as a node's ``data-path``), else the task's global test set.
    """
    if cfg["evaluate-every"] == 0:
        return None
    if cfg["central-data-path"]:
        try:
            test_set = load_evaluation_set(cfg["central-data-path"], task)
        except NodeDataError as error:
            raise ConfigError("central-data-path", error.problem) from None
    else:
        test_set = task.load_test(cfg)
    return _scorer(task, cfg, test_set)


def _scorer(
    task: Task, cfg: Mapping[str, Any], dataset: Dataset
) -> Callable[[Mapping[str, Any]], dict[str, float]]:
    """Return ``state dict -> metrics`` of the task's model on ``dataset``."""
    device = pick_device(cfg["device"])
    model = task.build_model()

    def evaluate(state: Mapping[str, Any]) -> dict[str, float]:
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        return evaluate_model(task, model, dataset, EVAL_BATCH_SIZE, device)

    return evaluate


def server_validation_loss(
    task: Task, cfg: Mapping[str, Any]
) -> Callable[[Mapping[str, Any]], float] | None:
    """Return the influence screen's ``arrays -> loss``, or None when it is off.

    None with ``validation-size = 0``. Asked for where it cannot act, it
    raises ``ConfigError`` before the run starts rather than run without the
    defence asked for: secure aggregation or a robust ``aggregation`` (no
    individual updates or no mean to leave one out of), or a task without a
    local training pool and no ``validation-data-path``. The examples are
    drawn with the run's ``seed`` from ``validation-data-path`` (its train
    split, checked as a node's data) or from the task's training pool. In a
    simulation that pool is the clients' data: the server's sample overlaps
    their partitions, as the root dataset of FLTrust (Cao et al. 2021) is
    drawn from the clients' training data in its experiments.
    """
    size = cfg["validation-size"]
    if size == 0:
        return None
    if cfg["secure-aggregation"] != "off" or cfg["aggregation"] not in ("auto", "mean"):
        raise ConfigError(
            "validation-size",
            "the influence screen needs the individual updates and their mean: "
            f"not with secure-aggregation={cfg['secure-aggregation']} or "
            f"aggregation={cfg['aggregation']} (set validation-size = 0)",
        )
    if cfg["validation-data-path"]:
        try:
            pool = load_validation_set(cfg["validation-data-path"], task)
        except NodeDataError as error:
            raise ConfigError("validation-data-path", error.problem) from None
    else:
        spec = task.data_spec
        if spec is None or spec.pool is None:
            raise ConfigError(
                "validation-size",
                f"task {task.name} has no local training pool to draw the "
                "server's validation set from: set validation-data-path",
            )
        pool = spec.pool(cfg)
    rng = np.random.default_rng(cfg["seed"])
    count = len(pool.tensors[1])
    chosen = np.sort(rng.choice(count, min(size, count), replace=False))
    sample = TensorDataset(*(t[torch.from_numpy(chosen)] for t in pool.tensors))
    score = _scorer(task, cfg, sample)
    return lambda state: score(state)["loss"]


def record_local_update(recorder: RunRecorder, strategy: Any) -> None:
    """Record the local update the clients run: its name and hyperparameters."""
    update = getattr(strategy, "local_update", None)
    recorder.data["local_update"] = (
        {"name": "none"} if update is None else update.describe()
    )
    recorder.write()


def record_end(recorder: RunRecorder, strategy: Any) -> None:
    """Record why a run that completed ended: its last round, or the stop rule.

    ``stop_reason``: ``num-server-rounds``, ``stop-target`` or
    ``stop-patience`` (then ``stop_detail`` says which value, which round).
    """
    reason = getattr(strategy, "stop_reason", None)
    recorder.data["stop_reason"] = reason or "num-server-rounds"
    if reason is not None:
        recorder.data["stop_detail"] = strategy.stop_message


def save_final_model(run_dir: Path, state: Mapping[str, np.ndarray]) -> Path:
    """Write ``<run>/final_model.npz``: the model the run returned, atomically.

    ``state`` is the model whose metrics results.json reported last (with
    ``average-last-two`` the average (w_t + w_{t+1})/2, not the iterate
    checkpoint.pkl keeps); one array per state_dict key, read back with
    ``dict(np.load(path))``.
    """
    path = run_dir / FINAL_MODEL_FILE
    arrays: dict[str, Any] = dict(state)  # typed for savez(file, **arrays)
    with atomic_open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


class RoundHook:
    """Called once per round by the strategy (as Flower's central evaluation).

    Evaluates centrally when due, records the round (with the strategy's
    reports) and writes checkpoints. ``latest`` returns the global model to
    checkpoint (not the evaluation average); ``evaluate`` is the central
    evaluator when the caller built it already (to check the data early).
    """

    def __init__(
        self,
        cfg: Mapping[str, Any],
        task: Task,
        strategy: Any,
        recorder: RunRecorder,
        first_round: int = 0,
        latest: Callable[[], State] | None = None,
        evaluate: Callable[[Mapping[str, Any]], dict[str, float]] | None = None,
    ) -> None:
        self.cfg, self.strategy, self.recorder = cfg, strategy, recorder
        # None when central evaluation is off (evaluate-every=0)
        self.evaluate = evaluate or central_evaluator(task, cfg)
        self.first_round = first_round
        self.latest = latest

    def __call__(self, server_round: int, state: Mapping[str, Any]) -> dict | None:
        """Handle the end of ``server_round`` (``first_round``: the start)."""
        every, num_rounds = self.cfg["evaluate-every"], self.cfg["num-server-rounds"]
        evaluate = self.evaluate
        if server_round == self.first_round:
            if self.first_round == 0:
                scores = evaluate(state) if every and evaluate else None
                self.recorder.record_initial(scores)
            return None
        due = every > 0 and (server_round % every == 0 or server_round == num_rounds)
        scores = evaluate(state) if due and evaluate else None
        reports = getattr(self.strategy, "round_reports", {})
        ckpt = self.cfg["checkpoint-every"]
        save = bool(ckpt) and (server_round % ckpt == 0 or server_round == num_rounds)
        # a checkpoint amends the round's entry and writes results.json: once
        self.recorder.record_round(
            server_round,
            num_rounds,
            scores,
            reports.get(server_round, {}),
            write=not save,
        )
        if save:
            self.checkpoint(server_round)
        return scores

    def checkpoint(self, server_round: int) -> None:
        """Save the checkpoint of ``server_round``; record its size and time.

        A failed write (full disk, unwritable folder) keeps the previous
        checkpoint (:func:`save_checkpoint`), is logged and recorded in the
        round's ``checkpoint`` entry; the run goes on (our choice: losing a
        checkpoint must not lose the run).
        """
        assert self.latest is not None, "checkpoints need the latest global model"
        entry: dict[str, Any] = {}
        started = time.perf_counter()
        try:
            entry["bytes"] = save_checkpoint(
                self.recorder.run_dir / CHECKPOINT_FILE,
                server_round,
                self.latest(),
                self.strategy.state_dict(),
                self.recorder.data,
            )
        except OSError as error:
            entry["error"] = f"{type(error).__name__}: {error}"
            log(
                logging.WARNING,
                "fedadapt: round %d: checkpoint not written (%s); "
                "the last good one is kept",
                server_round,
                entry["error"],
            )
        entry["seconds"] = time.perf_counter() - started
        self.recorder.data["rounds"][-1]["checkpoint"] = entry
        try:
            self.recorder.write()
        except OSError:
            pass  # the same disk trouble; results.json is rewritten next round


def ended_by(error: BaseException) -> tuple[str, str]:
    """Return results.json's (status, error) for a run that raised ``error``.

    A signal is not a failure of the run: Ctrl-C (``KeyboardInterrupt``) or
    SIGTERM/SIGQUIT (Flower's ServerApp process exits with ``SystemExit``)
    reach the ServerApp when the SuperLink, or the command that started the
    deployment, stops it; the run ends ``stopped``, the signal named, as
    ``fedadapt simulate`` and ``deploy`` mark it (#42). Anything else:
    ``failed`` with the exception.
    """
    if isinstance(error, KeyboardInterrupt):
        return "stopped", "the ServerApp was interrupted (SIGINT)"
    if isinstance(error, SystemExit):
        return (
            "stopped",
            f"the ServerApp was stopped by a signal (exit code {error.code})",
        )
    return "failed", repr(error)
