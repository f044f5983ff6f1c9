"""What a task is: a dataset, its client split, a model and how to score it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class ClientData:
    """One client's local data: what it trains on and what it evaluates on."""

    train: Dataset
    test: Dataset


@dataclass(frozen=True)
class Task:
    """A federated learning task selected by ``task=<name>``.

    Attributes
    ----------
    name : str
        Registry name, e.g. ``"digits-mlp"``.
    summary : str
        One line for the README: dataset, model, source paper.
    build_model : Callable[[], nn.Module]
        Builds a freshly initialised model (seed torch before calling it).
    load_client : Callable[[Mapping, int, int], ClientData]
        ``(run_config, partition_id, num_partitions)`` → that client's data.
    load_test : Callable[[Mapping], Dataset]
        The global test set used for central evaluation.
    criterion : Callable[[], nn.Module]
        Builds the loss (mean over the batch).
    classification : bool
        Whether accuracy is a meaningful metric.
    paper_config : Mapping[str, Any]
        The source paper's setup as run-config overrides (written to
        ``conf/tasks/<name>.toml``), plus ``num-supernodes``, the number of
        clients, which is a federation setting.
    """

    name: str
    summary: str
    build_model: Callable[[], nn.Module]
    load_client: Callable[[Mapping[str, Any], int, int], ClientData]
    load_test: Callable[[Mapping[str, Any]], Dataset]
    criterion: Callable[[], nn.Module] = nn.CrossEntropyLoss
    classification: bool = True
    paper_config: Mapping[str, Any] = field(default_factory=dict)


def pick_device(name: str = "auto") -> torch.device:
    """Return the device named by run-config ``device``.

    ``auto`` takes ``cuda:0`` when this process sees a GPU (in simulation Ray
    sets ``CUDA_VISIBLE_DEVICES`` per actor, so index 0 is the actor's GPU),
    otherwise the CPU. ``cuda`` without a visible GPU is an error.
    """
    if name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda:0")
    if name == "cuda":
        raise RuntimeError("device='cuda' but this process sees no CUDA device")
    return torch.device("cpu")


@torch.no_grad()
def evaluate_model(
    task: Task,
    model: nn.Module,
    dataset: Dataset,
    batch_size: int,
    device: torch.device,
) -> dict[str, float]:
    """Return mean loss (and accuracy for classification) of ``model`` on data.

    Sums stay on ``device`` until the end: one host synchronisation per call.
    """
    model.to(device).eval()
    criterion = task.criterion()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    for inputs, targets in DataLoader(dataset, batch_size=batch_size):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        outputs = model(inputs)
        loss_sum += criterion(outputs, targets).double() * len(targets)
        if task.classification:
            correct += (outputs.argmax(dim=1) == targets).sum()
        count += len(targets)
    if count == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    metrics = {"loss": loss_sum.item() / count, "num-examples": float(count)}
    if task.classification:
        metrics["accuracy"] = correct.item() / count
    return metrics
