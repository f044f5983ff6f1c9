"""Legacy-API client: a ``flwr.client.NumPyClient`` over the same local round.

Use with :mod:`fedadapt.server.legacy_app` (components
``fedadapt.server.legacy_app:app`` / ``fedadapt.client.numpy_client:app``).

Parameter packing: the list is the model's ``state_dict`` arrays in order.
A local update's arrays (:mod:`fedadapt.client.local_update`; Fed-LAMB's
v̂ and v among them) follow, both ways, their names a
JSON list under ``local-update-arrays`` in the fit config (server → client)
and in the fit metrics (client → server); its client state is kept in the
node's ``context.state``, as the Message-API ClientApp keeps it.

Under SecAgg+ (the fit config carries :mod:`fedadapt.strategies.secagg`'s
settings) the reply is [Δ_i…, ‖Δ_i‖²] for Flower's ``secaggplus_mod`` to
mask, not the model (:meth:`FedAdaptClient._secure_reply`).
"""

from __future__ import annotations

from typing import Any

from flwr.client import Client, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import Context, Message, NDArrays, Scalar
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedadapt.client import worker
from fedadapt.client.node import partition_properties


def __getattr__(name: str) -> Any:
    """``FedAdaptClient`` and ``model_layout`` import PyTorch: on first use."""
    if name in ("FedAdaptClient", "model_layout"):
        from fedadapt.client import legacy_training

        return getattr(legacy_training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class WorkerClient(NumPyClient):
    """The legacy client of a one-message ``flwr-clientapp`` process.

    Fit and evaluate run on the node's warm worker
    (:mod:`fedadapt.client.worker`, ``client-worker``), as
    :class:`~fedadapt.client.legacy_training.FedAdaptClient` would run them
    here; the properties (the node's partition) need no training code.
    """

    def __init__(self, context: Context) -> None:
        self.context = context

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        """Tell the server which partition this node holds (seeded sampling)."""
        return dict(partition_properties(self.context.node_config))

    def fit(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """Train one round on the worker; return (arrays [+ local], n, metrics)."""
        arrays, num_examples, metrics = worker.call(
            "legacy-fit", (parameters, dict(config)), self.context
        )
        worker.as_own_process(metrics)
        return arrays, num_examples, metrics

    def evaluate(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[float, int, dict[str, Scalar]]:
        """Evaluate on the worker; return (loss, n, metrics)."""
        return worker.call(  # type: ignore[no-any-return]
            "legacy-evaluate", (parameters, dict(config)), self.context
        )


def client_fn(context: Context) -> Client:
    """Build the client of one SuperNode (on the node's worker where it pays)."""
    if worker.uses_worker(dict(context.run_config)):
        return WorkerClient(context).to_client()
    from fedadapt.client.legacy_training import FedAdaptClient

    return FedAdaptClient(
        context.run_config, context.node_config, context.state, context.node_id
    ).to_client()


def secure_aggregation_mod(
    msg: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """Flower's ``secaggplus_mod`` for the SecAgg+ workflow's messages only.

    A train message of ``SecAggPlusWorkflow`` carries its ConfigRecord
    (Flower's ``RECORD_KEY_CONFIGS``); every other message (plain rounds,
    evaluation, queries) goes straight to the client, so one ClientApp
    serves both modes.
    """
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


#: the ClientApp's mods (tests that build their own ClientApp use them too)
MODS: list[Mod] = [secure_aggregation_mod]

app = ClientApp(client_fn=client_fn, mods=MODS)
