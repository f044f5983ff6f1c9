"""Tasks: datasets, models and non-IID partitions, selected by ``task=<name>``."""

from fedadapt.registry import Registry
from fedadapt.tasks.base import ClientData, DataSpec, Task, evaluate_model, pick_device
from fedadapt.tasks.digits import DIGITS_MLP
from fedadapt.tasks.paper_tasks import PAPER_TASKS

TASKS: Registry[Task] = Registry("task")
for _task in (DIGITS_MLP, *PAPER_TASKS):
    TASKS.register(_task.name)(_task)

__all__ = ["TASKS", "ClientData", "DataSpec", "Task", "evaluate_model", "pick_device"]
