"""Tasks: datasets, models and non-IID partitions, selected by ``task=<name>``."""

from fedadapt.registry import Registry
from fedadapt.tasks.base import ClientData, Task, evaluate_model, pick_device
from fedadapt.tasks.digits import DIGITS_MLP

TASKS: Registry[Task] = Registry("task")
TASKS.register(DIGITS_MLP.name)(DIGITS_MLP)

__all__ = ["TASKS", "ClientData", "Task", "evaluate_model", "pick_device"]
