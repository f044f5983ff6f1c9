"""What a task is: a dataset, its client split, a model and how to score it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset


@dataclass(frozen=True)
class ClientData:
    """One client's local data: what it trains on and what it evaluates on."""

    train: Dataset
    test: Dataset


@dataclass(frozen=True)
class DataSpec:
    """What one sample of a task looks like: node data is checked against it.

    The task fixes the model, so a node's own files (``data-path``,
    :mod:`fedadapt.tasks.node_data`) must give inputs of ``input_shape``
    (float32) and integer labels in ``0..num_classes-1``. Images become
    inputs as the task's own pipeline makes them: ``image_shape`` is
    (height, width, channels), pixels are divided by 255, normalised with
    ``mean``/``std`` per channel, put channels first and reshaped to
    ``input_shape``. ``pool`` returns the task's training pool as a
    ``TensorDataset`` of model-ready inputs (for ``fedadapt make-node-data``),
    where the task has one locally.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    image_shape: tuple[int, int, int]
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    pool: Callable[[Mapping[str, Any]], TensorDataset] | None = None


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
    data_spec : DataSpec or None
        The sample format node data (``data-path``) must have; ``None``:
        the task reads no node data.
    """

    name: str
    summary: str
    build_model: Callable[[], nn.Module]
    load_client: Callable[[Mapping[str, Any], int, int], ClientData]
    load_test: Callable[[Mapping[str, Any]], Dataset]
    criterion: Callable[[], nn.Module] = nn.CrossEntropyLoss
    classification: bool = True
    paper_config: Mapping[str, Any] = field(default_factory=dict)
    data_spec: DataSpec | None = None


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


class TensorRows(Dataset):
    """Rows of equally long tensors that a DataLoader fetches a batch at a time.

    A ``Subset`` of a ``TensorDataset`` makes the DataLoader fetch every
    sample alone and stack them again (``default_collate``): a Python call
    per sample, about 5 % of a small CNN's local epoch on the CPU. Here the
    fetcher's ``__getitems__`` indexes each tensor once per batch. The batch
    holds the same values in the same order and the DataLoader's sampler
    draws from its generator exactly as before, so training is bit-identical.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        """Return the whole batch: one indexing per tensor (the fast path)."""
        rows = torch.as_tensor(indices, dtype=torch.int64)
        return tuple(t[rows] for t in self.tensors)


def _whole_batch(batch: Any) -> list[torch.Tensor]:
    """collate_fn for :class:`TensorRows`: the batch is already stacked."""
    return list(batch)


def batch_loader(dataset: Dataset, batch_size: int, **kwargs: Any) -> DataLoader:
    """Return a DataLoader over ``dataset`` that fetches a batch at a time.

    A ``TensorDataset`` or a ``Subset`` of one is served by
    :class:`TensorRows` (the subset's rows gathered once); any other
    dataset gets the plain DataLoader. Same batches, same sampler draws.
    """
    base, rows = dataset, None
    if isinstance(base, Subset) and isinstance(base.dataset, TensorDataset):
        index = torch.as_tensor(base.indices, dtype=torch.int64)
        rows = TensorRows(tuple(t[index] for t in base.dataset.tensors))
    elif isinstance(base, TensorDataset):
        rows = TensorRows(base.tensors)
    if rows is None:
        return DataLoader(dataset, batch_size=batch_size, **kwargs)
    return DataLoader(rows, batch_size=batch_size, collate_fn=_whole_batch, **kwargs)


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
    for inputs, targets in batch_loader(dataset, batch_size):
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
