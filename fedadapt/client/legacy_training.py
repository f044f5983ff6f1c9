"""The legacy-API client's training: :class:`FedAdaptClient` (PyTorch).

:mod:`fedadapt.client.numpy_client` builds it in the process Flower starts
or, in a deployment's one-message ``flwr-clientapp`` processes, has the
node's warm worker build it (:func:`fit` and :func:`evaluate` are the
worker's handlers: :mod:`fedadapt.client.worker`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flwr.client import NumPyClient
from flwr.common import Context, NDArrays, RecordDict, Scalar
from numpy.typing import NDArray

from fedadapt.client.local import evaluate_round, train_round
from fedadapt.client.node import (
    config_number,
    data_path_of,
    partition_of,
    partition_properties,
)
from fedadapt.config import validate_run_config
from fedadapt.strategies import wire
from fedadapt.strategies.local_update import legacy_names
from fedadapt.strategies.secagg import (
    SecAggPlusSettings,
    encode_update,
    hold_to_ranges,
    rotated_indices,
    to_secure_scale,
)
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
        self.node_config = node_config

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        """Tell the server which partition this node holds (seeded sampling)."""
        return dict(partition_properties(self.node_config))

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
            return self._secure_reply(
                parameters,
                arrays,
                metrics,
                config,
                result.local_arrays,
                dict(zip(local_names, local, strict=True)),
            )
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
        local: Mapping[str, NDArray[Any]] | None = None,
        received: Mapping[str, NDArray[Any]] | None = None,
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """Return the reply that ``secaggplus_mod`` masks: [Δ_i…, norm, flag].

        The update is clipped to the round's bound first, if it has one;
        a summable local update's arrays (Fed-LAMB's v) follow, in the
        scales the server sent (:func:`~fedadapt.strategies.secagg.
        to_secure_scale`: v over the ``received`` v̂) and held to its
        ranges (:func:`~fedadapt.strategies.secagg.
        hold_to_ranges`; ``secagg-local-clipped`` 1 when that cut one),
        their names in the clear metrics; the norm leaves the clear metrics (only
        arrays are masked); the
        weight is 1 under uniform weighting; the count of coordinates
        SecAgg+ would clip goes in the clear metrics
        (:func:`fedadapt.strategies.secagg.encode_update`).
        """
        sq_norm = float(metrics.pop(wire.UPDATE_SQ_NORM))
        num_examples = int(metrics.pop(wire.NUM_EXAMPLES))
        names = set(self.names)  # what update-sq-norm was summed over
        trainable = [k in names for k in self.keys]
        cut = False
        if local:
            local, cut = hold_to_ranges(
                to_secure_scale(local, config, received), config
            )
        update, weight, clipped = encode_update(
            sent,
            arrays,
            sq_norm,
            num_examples,
            config,
            trainable=trainable,
            local=local,
        )
        if local:
            metrics[wire.LOCAL_ARRAYS] = json.dumps(list(local))
        rotated = rotated_indices(config, trainable)
        if rotated:
            metrics[wire.SECAGG_ROTATED] = json.dumps(rotated)
        metrics[wire.SECAGG_CLIPPED] = clipped
        if local:
            metrics[wire.SECAGG_LOCAL_CLIPPED] = int(cut)
            # the scales v took, echoed: the server refuses a reply without
            metrics[wire.SECAGG_LOCAL_SCALES] = str(
                config.get(wire.SECAGG_LOCAL_SCALES, "")
            )
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


def fit(content: tuple[NDArrays, dict[str, Scalar]], context: Context) -> Any:
    """Run ``FedAdaptClient.fit(parameters, config)`` (the worker's legacy fit)."""
    return _client(context).fit(*content)


def evaluate(content: tuple[NDArrays, dict[str, Scalar]], context: Context) -> Any:
    """Run ``FedAdaptClient.evaluate(parameters, config)`` on the worker."""
    return _client(context).evaluate(*content)


def _client(context: Context) -> FedAdaptClient:
    return FedAdaptClient(
        context.run_config, context.node_config, context.state, context.node_id
    )
