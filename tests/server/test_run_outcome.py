"""Issue #26 part 7: a run in which no round used any reply has not trained.

Clients that all fail for fewer rounds than ``max-failed-rounds`` (here: a
missing dependency on every node) used to end ``completed``; the run must end
``failed`` with the clients' error text, in both the Message-API and the
legacy ServerApp. The ServerApps run for real against stand-ins for Flower's
grid / client proxies that answer every train message with an error.
"""

from __future__ import annotations

import json

import pytest
from flwr.app import Context, Error, Message, RecordDict
from flwr.server.client_proxy import ClientProxy

from fedadapt.server import legacy_app, server_app
from fedadapt.server.run_folder import RunFolder
from fedadapt.strategies.adapter import FederationFailedError

pytestmark = pytest.mark.usefixtures("task_identity")

CLIENT_ERROR = "No module named 'missing_dependency'"


class FailingGrid:
    """Two connected nodes whose every reply is an error (Flower's error reply)."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]

    def send_and_receive(self, messages, *, timeout=None):
        return [
            Message(Error(code=0, reason=CLIENT_ERROR), reply_to=m) for m in messages
        ]


class FailingProxy(ClientProxy):
    """A legacy client whose every call raises (as a ClientApp missing a module)."""

    def _fail(self, *args, **kwargs):
        raise RuntimeError(CLIENT_ERROR)

    get_properties = get_parameters = fit = evaluate = reconnect = _fail


def _run(api: str, run_config: dict) -> None:
    context = Context(1, 0, {}, RecordDict(), run_config)
    if api == "message":
        server_app.main(FailingGrid(), context)  # type: ignore[arg-type]
        return
    server = legacy_app.server_fn(context).server
    for cid in ("a", "b"):
        server.client_manager().register(FailingProxy(cid))
    with legacy_app.make_app(legacy_app.server_fn)._lifespan(context):
        server.fit(run_config["num-server-rounds"], None)


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize("max_failed_rounds", [3, 0])
def test_a_run_without_one_usable_reply_ends_failed_with_the_clients_error(
    tmp_path, api, max_failed_rounds
):
    # two rounds: fewer than max-failed-rounds=3 (or 0 = never stop early)
    run_config = {
        "output-dir": str(tmp_path), "run-name": "nothing", "num-server-rounds": 2,
        "max-failed-rounds": max_failed_rounds, "clients-per-round": 2,
        "evaluate-every": 0,
    }  # fmt: skip
    with pytest.raises(FederationFailedError, match="missing_dependency"):
        _run(api, run_config)
    data = json.loads((tmp_path / "nothing" / "results.json").read_text())
    assert [r["replies"]["used"] for r in data["rounds"]] == [0, 0]
    assert [r["replies"]["failed"] for r in data["rounds"]] == [2, 2]
    assert data["status"] == "failed"
    assert "no round of the run used a train reply (2 rounds)" in data["error"]
    assert "missing_dependency" in data["error"]
    # the ended run let go of its folder: a new run may replace it
    RunFolder.claim(tmp_path / "nothing", overwrite=True).release()
