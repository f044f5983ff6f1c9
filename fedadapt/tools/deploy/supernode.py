"""Flower's SuperNode with a wait for messages that follows the federation (#40).

``fedadapt-supernode`` takes exactly ``flower-supernode``'s flags and runs
Flower's own SuperNode, with two waits shortened. Flower 1.41/1.42's
SuperNode loop (``flwr.supernode.start_client_internal``) sleeps a fixed
3 s whenever a pull from the SuperLink finds no message, and 0.5 s between
its looks for the ClientApp's reply in its own memory. In a federation a
round's next message comes a second or two after the node's reply, so the
3-s sleep costs every round 1.5 s on average (up to 3 s) before the message
is even seen; the reply loop 0.25 s more per message. Neither has a setting.

Here the idle wait starts at :data:`IDLE_POLL_MIN_S` after every message and
grows by :data:`IDLE_POLL_GROWTH` per empty pull up to Flower's 3 s
(:class:`IdlePoll`): a node between rounds sees the next message within
about a third of the time it has waited (the mean wait of a pull grows
with the gap, as Flower's fixed clock does not), and an idle node polls as
Flower's does once ~8 s have passed, so a thousand idle nodes cost the
SuperLink what they cost before (the burst after each message is 9 pulls).
The local reply look runs every :data:`REPLY_POLL_S` (an in-memory check).

How: the module's global ``time`` is replaced by a proxy whose ``sleep``
maps Flower's two constants to these waits (every other attribute is the
real module's), and its ``_pull_and_store_message`` is wrapped to restart
the schedule when a message arrives. :func:`install` checks that the loop
still reads as this module expects (the constants in its source) and
otherwise leaves Flower's SuperNode unchanged, with a warning: a Flower
that changed its loop runs as Flower wrote it, never half patched.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

LOGGER = logging.getLogger(__name__)

#: Flower's fixed sleep after a pull that found no message (seconds).
FLOWER_IDLE_SLEEP_S = 3
#: Flower's fixed sleep between looks for the ClientApp's reply (seconds).
FLOWER_REPLY_SLEEP_S = 0.5
#: First wait after a message (seconds).
IDLE_POLL_MIN_S = 0.1
#: Factor by which each empty pull lengthens the next wait.
IDLE_POLL_GROWTH = 1.5
#: Wait between looks for the ClientApp's reply in the node's memory (seconds).
REPLY_POLL_S = 0.05


class IdlePoll:
    """The wait before the next pull: ``first``, times ``growth`` each time, ≤ ``last``.

    :meth:`restart` after a message; :meth:`take` returns the wait to sleep
    now and lengthens the next one.
    """

    def __init__(
        self,
        first: float = IDLE_POLL_MIN_S,
        growth: float = IDLE_POLL_GROWTH,
        last: float = FLOWER_IDLE_SLEEP_S,
    ) -> None:
        if not 0 < first <= last:
            raise ValueError(f"IdlePoll: need 0 < first <= last, got {first}, {last}")
        if growth < 1:
            raise ValueError(f"IdlePoll: growth must be >= 1, got {growth}")
        self.first, self.growth, self.last = first, growth, last
        self.next = last  # a node that just started has seen no message yet

    def restart(self) -> None:
        """Start over from the shortest wait: a message arrived."""
        self.next = self.first

    def take(self) -> float:
        """Return the wait to sleep now; the next one is ``growth`` times longer."""
        wait = self.next
        self.next = min(self.last, wait * self.growth)
        return wait


class _ShortWaits:
    """Stand-in for the ``time`` module that shortens Flower's two fixed sleeps."""

    def __init__(self, real: ModuleType, poll: IdlePoll) -> None:
        self._real, self._poll = real, poll

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_IDLE_SLEEP_S:
            seconds = self._poll.take()
        elif seconds == FLOWER_REPLY_SLEEP_S:
            seconds = REPLY_POLL_S
        self._real.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _loop_as_expected(module: ModuleType) -> bool:
    """Tell whether ``module``'s SuperNode loop has the two sleeps mapped here."""
    import inspect

    try:
        loop = inspect.getsource(module.start_client_internal)
        push = inspect.getsource(module._push_messages)
    except (AttributeError, OSError, TypeError):
        return False
    return (
        getattr(module, "time", None) is time
        and callable(getattr(module, "_pull_and_store_message", None))
        and f"time.sleep({FLOWER_IDLE_SLEEP_S})" in loop
        and f"time.sleep({FLOWER_REPLY_SLEEP_S})" in push
    )


def install(module: ModuleType, poll: IdlePoll | None = None) -> bool:
    """Shorten the SuperNode loop's waits in ``module``; False if it is not as expected.

    ``module`` is ``flwr.supernode.start_client_internal`` (tests pass a
    stand-in). Idempotent: a module already patched is left as it is.
    """
    if isinstance(getattr(module, "time", None), _ShortWaits):
        return True
    if not _loop_as_expected(module):
        LOGGER.warning(
            "fedadapt-supernode: this Flower's SuperNode loop is not the one "
            "expected (flwr 1.41/1.42); running it unchanged (3-s idle poll)"
        )
        return False
    schedule = poll or IdlePoll()
    pull: Callable[..., Any] = module._pull_and_store_message

    def pull_and_restart(*args: Any, **kwargs: Any) -> Any:
        run_id = pull(*args, **kwargs)
        if run_id is not None:
            schedule.restart()
        return run_id

    module._pull_and_store_message = pull_and_restart  # type: ignore[attr-defined]
    module.time = _ShortWaits(time, schedule)  # type: ignore[attr-defined]
    return True


class _WarmSuperExec:
    """Stand-in for the SuperNode's ``subprocess``: our SuperExec for Flower's."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def Popen(self, args: Any, *rest: Any, **kwargs: Any) -> Any:  # noqa: N802
        if isinstance(args, list) and args and args[0] == "flower-superexec":
            args = [sys.executable, "-m", "fedadapt.tools.deploy.superexec", *args[1:]]
        return self._real.Popen(args, *rest, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def use_warm_superexec(module: ModuleType) -> bool:
    """Have ``module``'s SuperNode start :mod:`fedadapt.tools.deploy.superexec`.

    The SuperNode (``--isolation subprocess``, Flower's default) starts its
    SuperExec as ``subprocess.Popen(["flower-superexec", ...])``; ours takes
    the same flags and forks each ClientApp process from one that has
    Flower imported. False (and Flower's SuperExec) if the loop differs.
    """
    import inspect
    import subprocess

    if isinstance(getattr(module, "subprocess", None), _WarmSuperExec):
        return True
    try:
        source = inspect.getsource(module.start_client_internal)
    except (AttributeError, OSError, TypeError):
        source = ""
    from importlib.util import find_spec

    from fedadapt.tools.deploy.superexec import EXECUTOR_MODULE

    try:
        has_executor = find_spec(EXECUTOR_MODULE) is not None
    except ImportError:
        has_executor = False
    if (
        getattr(module, "subprocess", None) is not subprocess
        or '"flower-superexec"' not in source
        or not has_executor
    ):
        LOGGER.warning(
            "fedadapt-supernode: this Flower's SuperNode does not start "
            "flower-superexec as expected; using Flower's SuperExec"
        )
        return False
    module.subprocess = _WarmSuperExec(subprocess)  # type: ignore[attr-defined]
    return True


#: ``FEDADAPT_SUPERNODE_PARTS``: which changes to Flower's SuperNode to make,
#: comma-separated (``poll``: the short waits; ``fork``: the warm SuperExec);
#: empty runs Flower's SuperNode unchanged (benchmarks measure each part).
PARTS_ENV = "FEDADAPT_SUPERNODE_PARTS"
PARTS = ("poll", "fork")


def parts_from_env() -> set[str]:
    """Return the parts :data:`PARTS_ENV` names (all when unset; ValueError else)."""
    raw = os.environ.get(PARTS_ENV)
    if raw is None:
        return set(PARTS)
    named = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = named - set(PARTS)
    if unknown:
        raise ValueError(
            f"{PARTS_ENV}={raw!r}: unknown {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(PARTS)}"
        )
    return named


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``fedadapt-supernode [flower-supernode flags]``: Flower's SuperNode."""
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli import flower_supernode

    # our warnings on stderr, without a root handler: Flower's loggers
    # propagate to the root, and one there would print each of their lines twice
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.propagate = False
    parts = parts_from_env()
    if "poll" in parts:
        install(start_client_internal)
    if "fork" in parts:
        use_warm_superexec(start_client_internal)
    from fedadapt.server.object_pull import shorten_object_pull_retry

    shorten_object_pull_retry()  # a message's objects trail it by ms
    sys.argv = ["flower-supernode", *(sys.argv[1:] if argv is None else argv)]
    flower_supernode()


if __name__ == "__main__":
    main()
