"""Pieces of a run shared by the Message-API and the legacy ServerApp."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedadapt._atomic import atomic_open
from fedadapt.config import ConfigError
from fedadapt.registry import lookup
from fedadapt.server.checkpoint import CHECKPOINT_FILE, save_checkpoint
from fedadapt.server.results import RunRecorder
from fedadapt.server.run_folder import RunFolderError
from fedadapt.strategies._screening import FederationFailedError
from fedadapt.tasks import Task, evaluate_model, pick_device
from fedadapt.tasks.datasets import DatasetCorruptError, DatasetMissingError

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
    """Resolve every registry-backed key now, so a bad name fails at start."""
    for key in ("task", "strategy", "client-optimizer", "partition"):
        lookup(key).get(cfg[key])


def initial_state(task: Task, cfg: Mapping[str, Any]) -> State:
    """Return the seeded initial model as a NumPy state dict."""
    torch.manual_seed(cfg["seed"])
    return {k: v.numpy() for k, v in task.build_model().state_dict().items()}


def central_evaluator(
    task: Task, cfg: Mapping[str, Any]
) -> Callable[[Mapping[str, Any]], dict[str, float]]:
    """Return ``state dict -> metrics`` on the task's global test set."""
    test_set = task.load_test(cfg)
    device = pick_device(cfg["device"])
    model = task.build_model()

    def evaluate(state: Mapping[str, Any]) -> dict[str, float]:
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        return evaluate_model(task, model, test_set, EVAL_BATCH_SIZE, device)

    return evaluate


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
        self.evaluate = evaluate or central_evaluator(task, cfg)
        self.first_round = first_round
        self.latest = latest

    def __call__(self, server_round: int, state: Mapping[str, Any]) -> dict | None:
        """Handle the end of ``server_round`` (``first_round``: the start)."""
        every, num_rounds = self.cfg["evaluate-every"], self.cfg["num-server-rounds"]
        if server_round == self.first_round:
            if self.first_round == 0:
                self.recorder.record_initial(self.evaluate(state) if every else None)
            return None
        due = every > 0 and (server_round % every == 0 or server_round == num_rounds)
        scores = self.evaluate(state) if due else None
        reports = getattr(self.strategy, "round_reports", {})
        self.recorder.record_round(
            server_round, num_rounds, scores, reports.get(server_round, {})
        )
        ckpt = self.cfg["checkpoint-every"]
        if ckpt and (server_round % ckpt == 0 or server_round == num_rounds):
            assert self.latest is not None, "checkpoints need the latest global model"
            save_checkpoint(
                self.recorder.run_dir / CHECKPOINT_FILE,
                server_round,
                self.latest(),
                self.strategy.state_dict(),
                self.recorder.data,
            )
        return scores
