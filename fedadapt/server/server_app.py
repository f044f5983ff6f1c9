"""Message-API ServerApp: validates the run config, runs the strategy, records.

Everything is chosen by name through run-config (``task``, ``strategy``,
``client-optimizer``, ``partition``); an unknown name or invalid value fails
here, before any node is contacted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import InMemoryGrid

from fedadapt.config import ConfigError, validate_run_config
from fedadapt.server.checkpoint import load_checkpoint
from fedadapt.server.exchange import fast_pull
from fedadapt.server.partition_query import (
    Answer,
    NoAnswer,
    Refused,
    query_partition_ids,
)
from fedadapt.server.results import StartupPhases
from fedadapt.server.run import (
    RoundHook,
    central_evaluator,
    check_names,
    check_partition,
    claim_output_folder,
    ended_by,
    initial_state,
    log_user_errors_in_one_line,
    open_recorder,
    record_end,
    record_local_update,
    save_final_model,
    server_validation_loss,
)
from fedadapt.server.run_folder import RunFolder
from fedadapt.server.strategy_factory import build_strategy
from fedadapt.strategies import wire
from fedadapt.strategies.adapter import FederationFailedError
from fedadapt.tasks import TASKS

app = ServerApp()

#: After node loss, seconds a round waits for missing nodes before it samples
#: from the connected ones. Flower marks a SuperNode that stopped without
#: saying goodbye offline after two missed heartbeats (about 60 s); until
#: then its messages wait, and then come back as NODE_UNAVAILABLE errors,
#: counted as failed replies in results.json.
NODE_GRACE_S = 10.0

#: Seconds between two looks at the connected nodes while waiting for them.
NODE_POLL_S = 0.2


def wait_for_nodes(
    grid: Grid, wanted: int, timeout: float, simulation: bool = False
) -> int:
    """Wait until the nodes a run needs are connected; return how many are.

    ``wanted`` is run-config ``clients-per-round`` (0: every connected node,
    so at least one is needed). A simulation knows its size: its nodes are
    registered together right after the ServerApp starts, so once the count
    is non-zero and stable, a request larger than it fails at once. In
    deployment SuperNodes connect over time: wait up to ``timeout`` s.
    Raises ConfigError naming ``clients-per-round`` when too few connect.
    """
    needed = max(wanted, 1)
    deadline = time.monotonic() + timeout
    previous = -1
    while True:
        connected = len(list(grid.get_node_ids()))
        if simulation and connected and connected == previous:
            if connected < needed:
                raise ConfigError(
                    "clients-per-round",
                    f"{wanted} clients per round requested but the simulated "
                    f"federation has {connected} nodes; lower clients-per-round "
                    f"(0 = every node) or raise num-supernodes (flwr run "
                    f"--federation-config 'num-supernodes={wanted}')",
                )
            return connected
        if not simulation and connected >= needed:
            return connected
        if time.monotonic() >= deadline:
            raise ConfigError(
                "clients-per-round",
                f"{needed} clients per round needed but only {connected} nodes "
                f"connected after {timeout:g}s (node-wait-timeout)",
            )
        previous = connected
        time.sleep(NODE_POLL_S)


#: Error codes of a query reply that say the node has not answered yet (its
#: message or reply expired, the node is unavailable): it is asked again.
#: Other errors are its ClientApp failing on the query.
UNANSWERED_CODES = frozenset(
    {
        ErrorCode.MESSAGE_UNAVAILABLE,
        ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
        ErrorCode.NODE_UNAVAILABLE,
    }
)


class GridQuery:
    """The Message API's ``ask`` for :mod:`fedadapt.server.partition_query`.

    Each node gets one ``query`` message, pulled for across attempts, so a
    late answer still counts however long the node took (an attempt only
    bounds one wait). A node is sent a new message only when its reply says
    the message was not delivered (:data:`UNANSWERED_CODES`).
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.sent: dict[str, int] = {}  # message id -> node, reply outstanding

    def __call__(self, nodes: list[int], wait: float) -> dict[int, Answer]:
        """Query ``nodes`` (those without a message out); collect for ``wait`` s."""
        waiting = set(self.sent.values())
        messages = [
            Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY)
            for node in nodes
            if node not in waiting
        ]
        pushed = set(self.grid.push_messages(messages))  # a node left out: asked again
        self.sent.update(
            (m.metadata.message_id, m.metadata.dst_node_id)
            for m in messages
            if m.metadata.message_id in pushed
        )
        answers: dict[int, Answer] = {}
        deadline = time.monotonic() + wait
        while True:
            for reply in self.grid.pull_messages(list(self.sent)) if self.sent else ():
                node = self.sent.pop(reply.metadata.reply_to_message_id, None)
                if node is not None:
                    answers[node] = _answer(reply)
            done = all(node in answers for node in nodes)
            if done or time.monotonic() >= deadline:
                return answers
            time.sleep(min(NODE_POLL_S, max(deadline - time.monotonic(), 0.0)))


def _answer(reply: Message) -> Answer:
    """Return what one query reply says: the node's properties, or why not."""
    if reply.has_error():
        reason = f"error {reply.error.code}: {reply.error.reason}"
        if reply.error.code in UNANSWERED_CODES:
            return NoAnswer(reason)
        return Refused(reason)
    records = list(reply.content.metric_records.values())
    return dict(records[0]) if len(records) == 1 else {}


def node_partitions(grid: Grid, timeout: float) -> dict[int, int]:
    """Ask every connected node its ``partition-id``; return node id -> id.

    Nodes that have not answered are asked again until every connected node
    has, within ``timeout`` s in all (the run's ``round-timeout``): a slow
    node never changes the sample, the run fails naming it instead
    (:func:`~fedadapt.server.partition_query.query_partition_ids`, which also
    says what an invalid or missing partition-id does).
    """
    return query_partition_ids(
        lambda: list(grid.get_node_ids()), GridQuery(grid), timeout
    )


def _numpy(arrays: ArrayRecord) -> dict[str, Any]:
    return {k: v.numpy() for k, v in arrays.items()}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` rounds; write results.json, curves, final model.

    Everything that can be checked here is, before any node is contacted:
    the run config, the names it selects, the checkpoint to resume, the
    task's test data, in simulation whether the partition feeds every node,
    and the output folder. Such errors end the run (Flower: ``finished:failed``)
    with one log line that names the key or the missing files.

    Which model is which: results.json reports the metrics of the model the
    strategy returns each round (with ``average-last-two`` the average
    (w_t + w_{t+1})/2, also ``Result.arrays``, which a completed run writes
    to final_model.npz); checkpoint.pkl saves the
    iterate training continues from (``strategy.training_arrays``: w_{t+1})
    with the strategy's state, so a resume continues the same training.
    A stop rule (``stop-*``) may end the run early: results.json then says
    why (``stop_reason``; the last checkpoint is that of its schedule).

    Federated evaluation (``clients-per-eval`` > 0) rides on the train
    exchange in deployment (``federated-eval-exchange=auto``): round t's
    ``federated_eval`` then scores round t − 1's model (its
    ``model-round``), and one evaluate exchange after the last round scores
    the final model (``final_federated_eval``).
    """
    phases = StartupPhases()
    log_user_errors_in_one_line()
    cfg = validate_run_config(context.run_config)
    if cfg["secure-aggregation"] == "secagg+":
        # Flower has SecAgg+ for its legacy API only: this run goes there
        # (same results.json; the ClientApp hands those messages to the
        # legacy client, fedadapt.client.client_app)
        from fedadapt.server import legacy_app

        legacy_app.run(grid, context)
        return
    check_names(cfg)
    folder = claim_output_folder(cfg, context.run_id)  # a live run's folder: fail now
    phases.done("config")
    try:
        _run(grid, context, cfg, folder, phases)
    finally:
        folder.release()  # also when the run fails before results.json


def _run(
    grid: Grid,
    context: Context,
    cfg: dict[str, Any],
    folder: RunFolder,
    phases: StartupPhases,
) -> None:
    """Run :func:`main`'s rounds in its claimed ``folder``.

    ``phases`` times the start-up (results.json ``startup``).
    """
    task = TASKS.get(cfg["task"])
    resume = load_checkpoint(cfg["resume-from"], cfg) if cfg["resume-from"] else None
    # loads the test set (data checked now); None: central evaluation off
    evaluate = central_evaluator(task, cfg)
    screen = server_validation_loss(task, cfg)  # the influence screen's data
    phases.done("central_data")
    simulation = isinstance(grid, InMemoryGrid)
    # deployment: every exchange (train, evaluate) waits for its replies with
    # a short, backing-off pull instead of Flower's fixed 3 s (#40); the
    # simulation keeps its in-memory grid's faster 0.1-s loop
    grid = fast_pull(grid)
    num_nodes = wait_for_nodes(
        grid, cfg["clients-per-round"], cfg["node-wait-timeout"], simulation
    )
    if simulation:  # one federation, one data-dir: check the split feeds it
        check_partition(task, cfg, num_nodes)
    phases.done("nodes")
    if cfg["clients-per-round"] == 0:
        log(
            logging.INFO,
            "fedadapt: clients-per-round=0: every connected node "
            "trains each round (%d now)",
            num_nodes,
        )
    first_round = resume["round"] if resume is not None else 0
    strategy = build_strategy(
        cfg,
        num_nodes,
        sampling_seed=cfg["seed"] if cfg["seeded-sampling"] else None,
        node_grace_s=NODE_GRACE_S,  # node loss: go on with the others
        round_offset=first_round,
        deployment=not simulation,  # federated-eval-exchange=auto: with-train
        validation_loss=screen,
    )
    phases.done("strategy")
    wanted = (cfg["clients-per-round"], cfg["clients-per-eval"])
    if cfg["seeded-sampling"] and any(0 < k < num_nodes for k in wanted):
        # a real sample: order the nodes by partition-id (all of them, or fail)
        strategy.node_keys = node_partitions(grid, cfg["round-timeout"])
    phases.done("partition_query")
    state = initial_state(task, cfg)
    if resume is not None:
        state = resume["arrays"]
        strategy.load_state_dict(resume["strategy"])
    initial = ArrayRecord({k: Array(v) for k, v in state.items()})
    phases.done("initial_model")

    recorder = open_recorder(
        folder, cfg, context.run_id, previous=resume["results"] if resume else None
    )
    log(logging.INFO, "fedadapt: writing results to %s", recorder.run_dir)
    recorder.record_federated_exchange(
        "with-train" if strategy.folds_evaluation else "separate"
    )
    record_local_update(recorder, strategy)
    hook = RoundHook(
        cfg,
        task,
        strategy,
        recorder,
        first_round,
        evaluate=evaluate,
        latest=lambda: _numpy(strategy.training_arrays or initial),
    )

    phases.done("recorder")

    def on_round_end(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        scores = hook(server_round, _numpy(arrays))
        if "startup" not in recorder.data:  # the first call: the initial model's
            phases.done("initial_evaluation")
            recorder.record_startup(phases.seconds)
        return MetricRecord(scores) if scores else None

    try:
        result = strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=cfg["num-server-rounds"] - first_round,
            timeout=cfg["round-timeout"],
            train_config=ConfigRecord({wire.LR: cfg["client-lr"]}),
            evaluate_config=ConfigRecord({}),
            evaluate_fn=on_round_end,
        )
        failure = strategy.unusable_run_failure()
        if strategy.final_evaluation is not None:  # folded: the final model's
            recorder.record_final_evaluation(strategy.final_evaluation)
        if failure is None:
            save_final_model(recorder.run_dir, _numpy(result.arrays))
    except BaseException as error:
        recorder.finish(*ended_by(error))
        raise
    if failure is not None:  # not one reply used: nothing was trained
        recorder.finish("failed", error=failure)
        raise FederationFailedError(failure)
    record_end(recorder, strategy)
    recorder.finish("completed")
    log(logging.INFO, "fedadapt: results in %s", recorder.run_dir)
