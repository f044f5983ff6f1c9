"""fedadapt-supernode: Flower's SuperNode loop, its waits following messages (#40)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import time
from types import ModuleType

import pytest

from fedadapt.tools.deploy import supernode
from fedadapt.tools.deploy.supernode import IdlePoll, install

# A stand-in with the shape of flwr.supernode.start_client_internal (1.41/1.42):
# a pull that returns a run id or None, Flower's fixed 3-s sleep after an empty
# pull, and the 0.5-s look for the ClientApp's reply.
LOOP = """
import time

PULLS = []
REPLY_AFTER = [0]

def _pull_and_store_message(**kwargs):
    return PULLS.pop(0)

def _push_messages(**kwargs):
    while REPLY_AFTER[0] > 0:
        REPLY_AFTER[0] -= 1
        time.sleep(0.5)

def start_client_internal(**kwargs):
    while PULLS:
        run_id = _pull_and_store_message(state=None)
        if run_id is None:
            time.sleep({idle})
            continue
        _push_messages(state=None)
"""


def stand_in(tmp_path, name: str = "loop", idle: int = 3) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(LOOP.format(idle=idle)))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """Every time.sleep of the test, recorded instead of slept."""
    calls: list[float] = []
    monkeypatch.setattr(time, "sleep", calls.append)
    return calls


def test_idle_poll_closed_form():
    poll = IdlePoll(first=0.1, growth=1.5, last=3.0)
    assert poll.take() == 3.0  # no message seen yet: Flower's wait
    poll.restart()
    waits = [poll.take() for _ in range(11)]
    expected = [min(3.0, 0.1 * 1.5**k) for k in range(11)]
    assert waits == pytest.approx(expected)
    assert waits[-1] == 3.0  # back at Flower's rate after ~8 s idle
    assert sum(waits[:9]) == pytest.approx(sum(0.1 * 1.5**k for k in range(9)))


@pytest.mark.parametrize("bad", [dict(first=0), dict(first=4), dict(growth=0.5)])
def test_idle_poll_refuses_impossible_schedules(bad):
    with pytest.raises(ValueError):
        IdlePoll(**bad)


def test_unpatched_loop_sleeps_flowers_fixed_waits(tmp_path, slept):
    loop = stand_in(tmp_path)
    loop.PULLS[:] = [None, 7, None, None]
    loop.REPLY_AFTER[0] = 2
    loop.start_client_internal()
    assert slept == [3, 0.5, 0.5, 3, 3]


def test_patched_loop_waits_short_after_a_message_and_grows_back(tmp_path, slept):
    loop = stand_in(tmp_path)
    assert install(loop, IdlePoll(first=0.1, growth=1.5, last=3.0))
    loop.PULLS[:] = [None, 7, None, None, None, 8, None]
    loop.REPLY_AFTER[0] = 2
    loop.start_client_internal()
    # before any message: Flower's 3 s; the reply looks: 0.05 s each; after a
    # message: 0.1, 0.15, 0.225; a new message restarts the schedule
    assert slept == pytest.approx(
        [3.0, supernode.REPLY_POLL_S, supernode.REPLY_POLL_S, 0.1, 0.15, 0.225, 0.1]
    )
    assert install(loop)  # idempotent: the proxy is not wrapped twice
    assert loop.time.sleep.__self__._real is time


def test_a_changed_loop_runs_unchanged(tmp_path, slept, caplog):
    loop = stand_in(tmp_path, name="other", idle=2)
    assert not install(loop)
    assert loop.time is time
    assert "running it unchanged" in caplog.text
    loop.PULLS[:] = [None, None]
    loop.start_client_internal()
    assert slept == [2, 2]


def test_installed_flower_has_the_loop_this_module_patches():
    """Fails when a Flower release changes its SuperNode loop (then revisit)."""
    from flwr.supernode import start_client_internal as real

    assert supernode._loop_as_expected(real)
    # patch a private copy, not the module the test process may use
    spec = importlib.util.find_spec("flwr.supernode.start_client_internal")
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    sys.modules["_fedadapt_test_sci_copy"] = copy
    try:
        spec.loader.exec_module(copy)
        assert install(copy)
        assert isinstance(copy.time, supernode._ShortWaits)
        assert real.time is time
    finally:
        del sys.modules["_fedadapt_test_sci_copy"]


def test_the_supernode_starts_with_the_short_object_pull_retry(monkeypatch):
    """fedadapt-supernode retries a message's missing objects after 0.05 s
    from its first message on (fedadapt.server.object_pull; Flower: 1 s)."""
    import flwr.supernode.cli
    from flwr.supercore.inflatable import inflatable_utils

    retry = inflatable_utils.pull_objects.__kwdefaults__
    monkeypatch.setitem(retry, "initial_backoff", 1)  # Flower's
    seen = {}

    def flower_supernode():  # stands in for Flower's, which would run forever
        seen["argv"] = list(sys.argv)
        seen["retry"] = retry["initial_backoff"]

    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", flower_supernode)
    monkeypatch.setenv(supernode.PARTS_ENV, "")  # leave Flower's loop alone here
    # main() gives its logger a handler and stops propagation: undo after
    monkeypatch.setattr(supernode.LOGGER, "handlers", [])
    monkeypatch.setattr(supernode.LOGGER, "propagate", True)
    supernode.main(["--insecure"])
    assert seen == {"argv": ["flower-supernode", "--insecure"], "retry": 0.05}
