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

import json
from collections.abc import Mapping
from typing import Any

from flwr.client import Client, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import Context, Message, NDArrays, RecordDict, Scalar
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedadapt.client.local import evaluate_round, train_round
from fedadapt.client.node import config_number, data_path_of, partition_of
from fedadapt.config import validate_run_config
from fedadapt.strategies import wire
from fedadapt.strategies.local_update import legacy_names
from fedadapt.strategies.secagg import SecAggPlusSettings, encode_update
from fedadapt.tasks import TASKS


def model_layout(cfg: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Return (state_dict keys, trainable parameter names) of the task's model."""
    model = TASKS.get(cfg["task"]).build_model()
    return list(model.state_dict()), [name for name, _ in model.named_parameters()]


class FedAdaptClient(NumPyClient):
    """NumPyClient that trains with the run config's task and optimizer."""

    def __init__(
        self,
        run_config: Mapping[str, Any],
        node_config: Mapping[str, Any],
        state: RecordDict | None = None,
        node_id: int | None = None,
    ) -> None:
        self.cfg = validate_run_config(run_config)
        self.partition_id, self.num_partitions = partition_of(node_config)
        # the node's own data (node-config data-path), else its partition
        self.data_path = data_path_of(node_config)
        self.has_partition = wire.PARTITION_ID in node_config or not self.data_path
        self.node_id = node_id
        self.keys, self.names = model_layout(self.cfg)
        self.state = state  # the node's Context.state: a local update's client state

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        """Tell the server which partition this node holds (seeded sampling)."""
        if not self.has_partition:  # its own data only: no partition to name
            return {}
        return {
            wire.PARTITION_ID: self.partition_id,
            wire.NUM_PARTITIONS: self.num_partitions,
        }

    def fit(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """Train one round; return (arrays [+ local], n, metrics)."""
        n = len(self.keys)
        local_names: list[str] | str = []
        if wire.LOCAL_ARRAYS in config:
            local_names = legacy_names(config[wire.LOCAL_ARRAYS])
            if isinstance(local_names, str):
                raise ValueError(local_names)
        cut = len(parameters) - len(local_names)
        parameters, local = parameters[:cut], parameters[cut:]
        if len(parameters) != n:
            raise ValueError(
                f"expected {n} model arrays (+ {len(local_names)} local-update "
                f"arrays), got {len(parameters)} (+ {len(local)})"
            )
        result = train_round(
            self.cfg,
            self.partition_id,
            self.num_partitions,
            dict(zip(self.keys, parameters[:n], strict=True)),
            lr=config_number(config.get(wire.LR, self.cfg["client-lr"])),
            server_round=int(config_number(config.get(wire.SERVER_ROUND, 0))),
            config=config,
            local_arrays=dict(zip(local_names, local, strict=True)),
            client_state=self.state,
            data_path=self.data_path,
            node_id=self.node_id,
        )
        arrays = [result.state[k].numpy() for k in self.keys]
        metrics: dict[str, Scalar] = dict(result.metrics)
        if SecAggPlusSettings.from_fit_config(config) is not None:
            return self._secure_reply(parameters, arrays, metrics, config)
        if result.local_arrays is not None:
            arrays += list(result.local_arrays.values())
            metrics[wire.LOCAL_ARRAYS] = json.dumps(list(result.local_arrays))
        num_examples = int(metrics.pop(wire.NUM_EXAMPLES))
        return arrays, num_examples, metrics

    def _secure_reply(
        self,
        sent: NDArrays,
        arrays: NDArrays,
        metrics: dict[str, Scalar],
        config: dict[str, Scalar],
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """Return the reply that ``secaggplus_mod`` masks: [Δ_i…, ‖Δ_i‖²].

        The norm leaves the clear metrics (only arrays are masked); the
        weight is 1 under uniform weighting; the count of coordinates
        SecAgg+ would clip goes in the clear metrics
        (:func:`fedadapt.strategies.secagg.encode_update`).
        """
        sq_norm = float(metrics.pop(wire.UPDATE_SQ_NORM))
        num_examples = int(metrics.pop(wire.NUM_EXAMPLES))
        update, weight, clipped = encode_update(
            sent, arrays, sq_norm, num_examples, config
        )
        metrics[wire.SECAGG_CLIPPED] = clipped
        return update, weight, metrics

    def evaluate(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[float, int, dict[str, Scalar]]:
        """Evaluate on the local test split; return (loss, n, metrics)."""
        state = dict(zip(self.keys, parameters[: len(self.keys)], strict=True))
        metrics: dict[str, Scalar] = dict(
            evaluate_round(
                self.cfg,
                self.partition_id,
                self.num_partitions,
                state,
                data_path=self.data_path,
                node_id=self.node_id,
            )
        )
        num_examples = int(metrics.pop(wire.NUM_EXAMPLES))
        return float(metrics["eval-loss"]), num_examples, metrics


def client_fn(context: Context) -> Client:
    """Build the client of one SuperNode."""
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
