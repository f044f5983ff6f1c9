"""Flower's object pull, retried after 0.05 s instead of 1 s (#40).

In Flower 1.41/1.42 a message travels as metadata plus an object tree, and
each receiver pulls the objects with ``pull_objects`` (and the ClientApp
process with ``pull_and_inflate_object_from_tree``). An object not yet at
the sender is retried after ``initial_backoff`` = 1 s (±20 %), doubling up
to 10 s. In a deployment the objects are usually a few milliseconds behind
their metadata, and three hops find them missing:

* the SuperNode stores a message (so that its SuperExec starts the
  ClientApp process) *before* it pulls the message's objects from the
  SuperLink; a ClientApp process that starts fast (the warm fork of
  :mod:`fedadapt.tools.deploy.superexec`) asks for them first and sleeps
  ~1 s — the ~1.1 s of each message's start-up that the profiles showed;
* a SuperNode that sees a message soon after the ServerApp pushed it (the
  short idle poll of :mod:`fedadapt.tools.deploy.supernode`) can find the
  objects not yet at the SuperLink;
* the ServerApp's pull of a reply (:mod:`fedadapt.server.exchange`) can
  find the reply's objects not yet pushed by the SuperNode.

:func:`shorten_object_pull_retry` sets the first retry of both Flower
functions to :data:`INITIAL_BACKOFF_S` (the keyword defaults of the
functions themselves, which every caller shares; the module constant is
bound at definition time and changing it would do nothing). The doubling,
the 10-s cap and the 2-h limit stay Flower's, so an object that is really
missing costs only a few more requests (0.05 + 0.1 + 0.2 + 0.4 + 0.8 s
before the pace is Flower's) and never a different outcome.

A Flower whose functions do not have the expected default (1 s) is left as
it is, with a warning. ``FEDADAPT_OBJECT_PULL=flower`` keeps Flower's 1 s
(the benchmarks measure the change against it in the same run).
"""

from __future__ import annotations

import logging
import os

LOGGER = logging.getLogger(__name__)

#: Flower 1.41/1.42's first retry of an object that is not there yet (s).
FLOWER_INITIAL_BACKOFF_S = 1
#: Ours (s).
INITIAL_BACKOFF_S = 0.05
#: ``flower`` keeps Flower's first retry; unset (or anything else): ours.
ENV = "FEDADAPT_OBJECT_PULL"
#: Where Flower keeps the two pulls.
MODULE = "flwr.supercore.inflatable.inflatable_utils"
FUNCTIONS = ("pull_objects", "pull_and_inflate_object_from_tree")


def shorten_object_pull_retry(initial_backoff: float = INITIAL_BACKOFF_S) -> bool:
    """Make Flower's object pulls in this process retry after ``initial_backoff``.

    Returns True when both functions retry so (idempotent), False when left
    as Flower wrote them (:data:`ENV` is ``flower``, or this Flower is not
    the expected one).
    """
    if not 0 < initial_backoff <= FLOWER_INITIAL_BACKOFF_S:
        raise ValueError(
            f"initial_backoff must be in (0, {FLOWER_INITIAL_BACKOFF_S}], "
            f"got {initial_backoff}"
        )
    if os.environ.get(ENV, "").strip().lower() == "flower":
        return False
    import importlib

    try:
        module = importlib.import_module(MODULE)
        defaults = [getattr(module, name).__kwdefaults__ for name in FUNCTIONS]
    except (ImportError, AttributeError):
        defaults = []
    expected = {FLOWER_INITIAL_BACKOFF_S, initial_backoff}
    if len(defaults) != len(FUNCTIONS) or not all(
        isinstance(d, dict) and d.get("initial_backoff") in expected for d in defaults
    ):
        LOGGER.warning(
            "fedadapt: this Flower's object pull is not the one expected "
            "(flwr 1.41/1.42: a first retry after %s s); left unchanged",
            FLOWER_INITIAL_BACKOFF_S,
        )
        return False
    for kwdefaults in defaults:
        kwdefaults["initial_backoff"] = initial_backoff
    return True
