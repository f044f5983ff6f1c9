"""Issue #40 item 1: federated evaluation folded into the train exchange.

In deployment every message costs seconds (a ClientApp process per message,
polling), so with ``federated-eval-exchange=with-train`` (the deployment
default) a round makes one exchange: each train message asks its client to
evaluate the received model first. Round t's train message carries round
t − 1's model, so its federated evaluation scores that model; one evaluate
exchange after the last round scores the final one.

The ServerApp runs for real here against a loopback grid that hands each
message to fedadapt's ClientApp functions in process (a grid that is not
Flower's InMemoryGrid: a deployment), so both settings run in seconds and
every exchange can be counted. Oracle: the separate evaluate exchange of the
same run config, whose models are the same (same seeds, same clients).
"""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType

from fedadapt.client import client_app
from fedadapt.config import ConfigError, validate_run_config
from fedadapt.server import server_app
from fedadapt.server.strategy_factory import build_strategy, evaluate_with_train
from fedadapt.strategies import wire
from fedadapt.tasks import TASKS

pytestmark = pytest.mark.usefixtures("task_identity")

NODES = 3
ROUNDS = 3
RUN = {
    "task": "digits-mlp",
    "local-steps": 2,
    "batch-size": 16,
    "num-server-rounds": ROUNDS,
    "clients-per-round": 0,  # every node trains ...
    "clients-per-eval": NODES,  # ... and every node evaluates
    "evaluate-every": 0,
    "checkpoint-every": 0,
}


class LoopbackGrid:
    """A deployment's grid, answered by fedadapt's ClientApp in process.

    ``exchanges`` lists, per ``send_and_receive``, the message types sent.
    """

    def __init__(self, run_config: dict) -> None:
        self.exchanges: list[list[str]] = []
        self.contexts = {
            node: Context(
                1,
                node,
                {"partition-id": node - 1, "num-partitions": NODES},
                RecordDict(),
                dict(run_config),
            )
            for node in range(1, NODES + 1)
        }

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.exchanges.append([m.metadata.message_type for m in messages])
        handlers = {
            MessageType.TRAIN: client_app.train,
            MessageType.EVALUATE: client_app.evaluate,
        }
        return [
            handlers[m.metadata.message_type](m, self.contexts[m.metadata.dst_node_id])
            for m in messages
        ]


def _run(tmp_path, exchange: str) -> tuple[dict, LoopbackGrid]:
    run_config = {**RUN, "federated-eval-exchange": exchange}
    grid = LoopbackGrid(run_config)
    server_config = {**run_config, "output-dir": str(tmp_path), "run-name": exchange}
    server_app.main(grid, Context(1, 0, {}, RecordDict(), server_config))  # type: ignore[arg-type]
    data = json.loads((tmp_path / exchange / "results.json").read_text())
    assert data["status"] == "completed"
    return data, grid


def test_folded_evaluation_scores_what_a_separate_exchange_scores(tmp_path):
    """auto in deployment folds: one exchange a round plus one for the final
    model; each folded score equals the separate exchange's score of the same
    model exactly, and results.json says which round's model it scored."""
    folded, folded_grid = _run(tmp_path, "auto")
    separate, separate_grid = _run(tmp_path, "separate")

    # exchanges: one per round + the final evaluation, against two per round
    assert folded_grid.exchanges == [[MessageType.TRAIN] * NODES] * ROUNDS + [
        [MessageType.EVALUATE] * NODES
    ]
    assert (
        separate_grid.exchanges
        == [
            [MessageType.TRAIN] * NODES,
            [MessageType.EVALUATE] * NODES,
        ]
        * ROUNDS
    )
    assert folded["evaluation"]["federated"]["exchange"] == "with-train"
    assert separate["evaluation"]["federated"]["exchange"] == "separate"

    # which model each federated evaluation scored
    assert [r["federated_eval"]["model-round"] for r in folded["rounds"]] == [0, 1, 2]
    assert [r["federated_eval"]["model-round"] for r in separate["rounds"]] == [
        1,
        2,
        3,
    ]
    assert folded["final_federated_eval"]["model-round"] == ROUNDS
    assert folded["final_evaluate_replies"]["used"] == NODES
    assert "final_federated_eval" not in separate

    # the same training ...
    for a, b in zip(folded["rounds"], separate["rounds"], strict=True):
        assert a["train"] == b["train"]
        assert a["evaluate_replies"]["used"] == NODES
    # ... and the same scores of the same models
    by_model = {r["federated_eval"]["model-round"]: r for r in folded["rounds"]}
    by_model[ROUNDS] = {"federated_eval": folded["final_federated_eval"]}
    for entry in separate["rounds"]:
        scores = by_model[entry["round"]]["federated_eval"]
        assert scores == entry["federated_eval"]
        assert scores["eval-loss"] > 0
    # round 1's folded evaluation scored the initial model: the worst one
    assert folded["rounds"][0]["federated_eval"]["eval-loss"] > max(
        r["federated_eval"]["eval-loss"] for r in separate["rounds"]
    )


def test_client_folded_evaluation_is_the_evaluate_message_reply(task_identity):
    """The ClientApp's folded scores are its evaluate reply's, kept apart from
    the train metrics; without the flag a train reply carries none."""
    torch.manual_seed(0)
    state = TASKS.get("digits-mlp").build_model().state_dict()
    context = LoopbackGrid(RUN).contexts[1]

    def message(kind: str, config: dict) -> Message:
        content = RecordDict(
            {
                wire.ARRAYS: ArrayRecord(state),
                wire.CONFIG: ConfigRecord({wire.SERVER_ROUND: 1, **config}),
            }
        )
        return Message(content, dst_node_id=1, message_type=kind)

    evaluated = client_app.evaluate(message(MessageType.EVALUATE, {}), context)
    trained = client_app.train(
        message(MessageType.TRAIN, {wire.EVALUATE_FIRST: True}), context
    )
    folded = trained.content.metric_records[wire.EVALUATE_METRICS]
    assert dict(folded) == dict(evaluated.content[wire.METRICS])
    assert "eval-loss" not in trained.content[wire.METRICS]
    plain = client_app.train(message(MessageType.TRAIN, {}), context)
    assert wire.EVALUATE_METRICS not in plain.content.metric_records


def test_auto_folds_in_deployment_only():
    cfg = validate_run_config({"clients-per-eval": 2})
    assert evaluate_with_train(cfg, deployment=True)
    assert not evaluate_with_train(cfg, deployment=False)  # simulation: separate
    for exchange, expected in (("with-train", True), ("separate", False)):
        cfg = validate_run_config({"clients-per-eval": 2, **_key(exchange)})
        assert evaluate_with_train(cfg, deployment=False) is expected
    off = validate_run_config({"clients-per-eval": 0, **_key("with-train")})
    assert not evaluate_with_train(off, deployment=True)  # nothing to fold


def _key(value: object) -> dict:
    return {"federated-eval-exchange": value}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("yes", "Valid values: auto, with-train, separate"),
        ("with_train", "Valid values: auto, with-train, separate"),
        (True, "expected a string"),
    ],
)
def test_a_bad_exchange_value_is_an_error_naming_the_key(value, says):
    for good in ("auto", "with-train", "separate"):
        assert validate_run_config(_key(good))["federated-eval-exchange"] == good
    with pytest.raises(ConfigError, match=f"'federated-eval-exchange'.*{says}"):
        validate_run_config(_key(value))


def test_with_train_refuses_what_it_cannot_fold():
    """average-last-two reports another model than the clients train from;
    the legacy API has no folded evaluation. auto falls back to separate."""
    averaged = {"strategy": "feddua", "feddua.average-last-two": True}
    cfg = validate_run_config({"clients-per-eval": 2, **averaged, **_key("with-train")})
    with pytest.raises(ConfigError, match="federated-eval-exchange.*average-last-two"):
        build_strategy(cfg, num_nodes=3, deployment=True)
    auto = validate_run_config({"clients-per-eval": 2, **averaged})
    assert not build_strategy(auto, num_nodes=3, deployment=True).folds_evaluation
    legacy = validate_run_config({"clients-per-eval": 2, **_key("with-train")})
    with pytest.raises(ConfigError, match="federated-eval-exchange.*legacy"):
        build_strategy(legacy, api="legacy")
