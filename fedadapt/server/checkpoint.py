"""Checkpoints: global model + strategy state + results so far, in one file.

A checkpoint is a pickle (only load files you wrote yourself) written
atomically to ``<run>/checkpoint.pkl``: to a temporary file of a unique name
in the same folder, flushed to disk, then renamed over the previous one, so
a write that fails (full disk, killed process) leaves the last good
checkpoint in place. Resuming from it with the same run
config reproduces an uninterrupted run exactly (client seeds derive from the
global round number, replies are aggregated in a canonical order, and with
``seeded-sampling`` the sample of a round depends on the seed, the global
round and the connected partitions only; with ``seeded-sampling=false`` only
full participation is reproduced).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedadapt._atomic import atomic_open
from fedadapt.config import ConfigError

CHECKPOINT_FILE = "checkpoint.pkl"
FORMAT_VERSION = 1
#: keys that must match between the checkpointed run and the resumed one
MUST_MATCH = ("task", "strategy", "client-optimizer", "partition", "seed")


def save_checkpoint(
    path: Path,
    server_round: int,
    arrays: Mapping[str, np.ndarray],
    strategy_state: Mapping[str, Any] | None,
    results: Mapping[str, Any],
) -> int:
    """Write a checkpoint for the state after ``server_round``; return its bytes.

    On any error the temporary file is removed and the previous checkpoint
    at ``path`` is left as it was; the error propagates.
    """
    payload = {
        "format": FORMAT_VERSION,
        "round": server_round,
        "arrays": {k: np.array(v, copy=True) for k, v in arrays.items()},
        "strategy": strategy_state,
        "results": results,
    }
    with atomic_open(path, "wb") as f:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
        size = f.tell()
    return size


def load_checkpoint(path: str | Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Read a checkpoint and check it fits run config ``cfg``.

    Raises ConfigError naming ``resume-from`` when the file is missing,
    unreadable, or was written by a run with another task/strategy/seed, or
    when ``num-server-rounds`` does not exceed the checkpointed round.
    """
    file = Path(path).expanduser()
    try:
        with file.open("rb") as f:
            payload = pickle.load(f)  # noqa: S301 (our own file, documented)
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        raise ConfigError("resume-from", f"cannot read {file}: {error}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise ConfigError("resume-from", f"{file} is not a fedadapt checkpoint")
    saved = payload["results"]["config"]
    for key in MUST_MATCH:
        if saved[key] != cfg[key]:
            raise ConfigError(
                "resume-from",
                f"checkpoint has {key}={saved[key]!r} but this run has {cfg[key]!r}",
            )
    if payload["round"] >= cfg["num-server-rounds"]:
        raise ConfigError(
            "resume-from",
            f"checkpoint is at round {payload['round']}; set num-server-rounds "
            "above it to continue",
        )
    return payload
