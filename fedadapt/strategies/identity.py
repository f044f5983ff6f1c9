"""The run identity Flower gives a run, for messages built outside one.

Flower 1.42 stamps every ``Message`` with the run's ids
(``flwr.supercore.task_identity.TaskIdentity``); a strategy's
``configure_train`` called by hand (a test, a notebook) has none set.
Needs flwr only (fedadapt's library tests run it without torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def task_identity(
    run_id: int = 1, node_id: int = 0, task_id: int = 1
) -> Iterator[None]:
    """Set the run identity Flower gives a run; restore it on exit.

    A ``Message`` built outside a run (a strategy's ``configure_train`` in a
    test) needs one.
    """
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
        run_id,
        node_id,
        task_id,
    )
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
