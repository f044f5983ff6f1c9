"""Flower's object pull retried after 0.05 s instead of 1 s (#40).

The oracle is Flower's own ``pull_objects``: an object that is missing at
the first try is asked for again after the wait the function really sleeps
(recorded from its ``Event.wait``), before and after the change.
"""

from __future__ import annotations

import threading

import pytest
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

from fedadapt.server import object_pull
from fedadapt.server.object_pull import (
    ENV,
    FLOWER_INITIAL_BACKOFF_S,
    FUNCTIONS,
    INITIAL_BACKOFF_S,
    shorten_object_pull_retry,
)


@pytest.fixture(autouse=True)
def flower_defaults(monkeypatch):
    """Give every test Flower's own defaults (tests/conftest.py puts back
    whatever the process had afterwards)."""
    monkeypatch.delenv(ENV, raising=False)
    for name in FUNCTIONS:
        getattr(inflatable_utils, name).__kwdefaults__["initial_backoff"] = (
            FLOWER_INITIAL_BACKOFF_S
        )


def first_retry_wait(monkeypatch) -> float:
    """Seconds Flower's ``pull_objects`` waits before asking again for an
    object that was missing once (its ``early_stop.wait``, recorded)."""
    waits: list[float] = []

    class RecordingEvent(threading.Event):
        def wait(self, timeout=None):
            if timeout is not None:
                waits.append(timeout)
                timeout = 0  # record the wait, do not spend it
            return super().wait(timeout)

    monkeypatch.setattr(inflatable_utils.threading, "Event", RecordingEvent)
    tries = {"n": 0}

    def pull(object_id: str) -> bytes:
        tries["n"] += 1
        if tries["n"] == 1:
            raise ObjectUnavailableError(object_id)
        return b"content"

    assert inflatable_utils.pull_objects(["a"], pull) == {"a": b"content"}
    monkeypatch.undo()
    assert tries["n"] == 2 and len(waits) == 1, waits
    return waits[0]


def test_a_missing_object_is_asked_for_again_after_50_ms_not_1_s(monkeypatch):
    flower = first_retry_wait(monkeypatch)
    assert 0.8 * FLOWER_INITIAL_BACKOFF_S <= flower <= 1.2 * FLOWER_INITIAL_BACKOFF_S
    assert shorten_object_pull_retry() is True
    ours = first_retry_wait(monkeypatch)
    assert 0.8 * INITIAL_BACKOFF_S <= ours <= 1.2 * INITIAL_BACKOFF_S  # ±20 % jitter
    # the ClientApp's pull passes the same default on to pull_objects
    tree_pull = inflatable_utils.pull_and_inflate_object_from_tree
    assert tree_pull.__kwdefaults__["initial_backoff"] == INITIAL_BACKOFF_S
    assert shorten_object_pull_retry() is True  # idempotent


def test_flower_s_wait_is_kept_when_asked(monkeypatch):
    monkeypatch.setenv(ENV, "flower")
    assert shorten_object_pull_retry() is False
    for name in FUNCTIONS:
        defaults = getattr(inflatable_utils, name).__kwdefaults__
        assert defaults["initial_backoff"] == FLOWER_INITIAL_BACKOFF_S


def test_a_flower_with_another_default_is_left_alone(monkeypatch, caplog):
    def pull_objects(ids, fn, *, initial_backoff=3.0):  # a future Flower's
        return {}

    monkeypatch.setattr(inflatable_utils, "pull_objects", pull_objects)
    with caplog.at_level("WARNING", logger=object_pull.__name__):
        assert shorten_object_pull_retry() is False
    assert pull_objects.__kwdefaults__ == {"initial_backoff": 3.0}
    tree_pull = inflatable_utils.pull_and_inflate_object_from_tree
    assert tree_pull.__kwdefaults__["initial_backoff"] == FLOWER_INITIAL_BACKOFF_S
    assert "not the one expected" in caplog.text


@pytest.mark.parametrize("wait", [0.0, -1.0, 2.0])
def test_an_impossible_first_wait_is_refused(wait):
    with pytest.raises(ValueError, match="initial_backoff"):
        shorten_object_pull_retry(wait)
