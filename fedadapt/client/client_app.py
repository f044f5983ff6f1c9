"""Message-API ClientApp: trains the task's model with the chosen optimizer.

Each SuperNode provides either ``partition-id`` and ``num-partitions`` in its
node config (a partition of the task's data; the simulation engine does this
automatically; in deployment pass ``--node-config "partition-id=0
num-partitions=10"``), or ``data-path``, its own data on disk
(:mod:`fedadapt.tasks.node_data`: a Hugging Face ``save_to_disk`` folder as
``flwr-datasets create`` writes, an image folder or an npz file), which then
takes precedence. Node data that is missing, unreadable or does not fit the
task fails the node's replies with one line naming the node and the path. When the train
config names a local update (``local-update``,
:mod:`fedadapt.client.local_update`; Fed-LAMB's v̂ and v among them), its
arrays arrive and leave as the ArrayRecord ``local-update-arrays`` and its
client state is kept in the node's ``context.state``. A train config with
``evaluate-first`` (run-config ``federated-eval-exchange``) has the node
evaluate the received model first, as an ``evaluate`` message would, and
send the scores with the trained model. A ``query`` message is
answered with the node's ``partition-id`` and ``num-partitions`` (the
ServerApp's seeded sampling orders nodes by them).

This module imports Flower only. The training work is in
:mod:`fedadapt.client.handlers`; in a deployment's one-message
``flwr-clientapp`` processes it runs in the node's warm worker
(:mod:`fedadapt.client.worker`; run-config ``client-worker``, ``auto``:
there, and nowhere else; ``off``: in each process as Flower starts it).
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedadapt.client import worker
from fedadapt.client.node import partition_properties
from fedadapt.strategies import wire

app = ClientApp()


#: Content keys of Flower's legacy messages (``flwr.compat``'s conversion of
#: FitIns, EvaluateIns and GetPropertiesIns)
LEGACY_PREFIXES = ("fitins.", "evaluateins.", "getpropertiesins.")


def is_legacy(msg: Message) -> bool:
    """Return whether ``msg`` comes from the legacy-API ServerApp.

    It does under ``secure-aggregation = "secagg+"`` (Flower has SecAgg+ for
    its legacy API only, so the Message-API ServerApp runs such runs there):
    a SecAgg+ stage message (its ConfigRecord) or a legacy fit / evaluate /
    get-properties message.
    """
    content = msg.content
    return RECORD_KEY_CONFIGS in content.config_records or any(
        key.startswith(LEGACY_PREFIXES) for key in content
    )


def legacy(msg: Message, context: Context) -> Message:
    """Answer a legacy message as the legacy ClientApp does (SecAgg+ mod included)."""
    from fedadapt.client import numpy_client

    return numpy_client.app(msg, context)


def handle(kind: str, content: RecordDict, context: Context) -> RecordDict:
    """Return the reply content of message ``kind``, here or on the worker."""
    if worker.uses_worker(dict(context.run_config)):
        answer: RecordDict = worker.call(kind, content, context)
        metrics = answer.metric_records.get(wire.METRICS)
        if metrics is not None:
            worker.as_own_process(metrics)
        return answer
    from fedadapt.client.handlers import HANDLERS

    reply: RecordDict = HANDLERS[kind](content, context)
    return reply


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition; reply with weights and metrics.

    See :func:`fedadapt.client.handlers.train` (federated evaluation folded
    in with ``evaluate-first``).
    """
    if is_legacy(msg):
        return legacy(msg, context)
    return Message(content=handle("train", msg.content, context), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received global model on the local test split."""
    if is_legacy(msg):
        return legacy(msg, context)
    return Message(content=handle("evaluate", msg.content, context), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds (no data is touched).

    A node with its own data (``data-path``) and no ``partition-id`` answers
    without one (it is sampled after the numbered nodes).
    """
    if is_legacy(msg):
        return legacy(msg, context)
    metrics = MetricRecord(dict(partition_properties(context.node_config)))
    return Message(content=RecordDict({wire.METRICS: metrics}), reply_to=msg)
