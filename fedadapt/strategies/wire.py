"""Names on the wire between fedadapt's strategies and clients, defined once.

Server (``fedadapt.strategies``) and clients (``fedadapt.client``) import
these; neither side spells them as string literals. The names are Flower
record and metric keys, so they match what Flower's own FedAvg sends and
reads where the concept is shared (``arrays``, ``config``, ``metrics``,
``num-examples``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

V = TypeVar("V")

# records of a train / evaluate message (RecordDict keys)
ARRAYS: Final = "arrays"  #: the model (ArrayRecord), both directions
CONFIG: Final = "config"  #: server → client settings (ConfigRecord)
METRICS: Final = "metrics"  #: client → server numbers (MetricRecord)
LOCAL_ARRAYS: Final = "local-update-arrays"  #: a local update's arrays, both ways

# entries of the server's train config
LR: Final = "lr"  #: client learning rate η_l of the round
SERVER_ROUND: Final = "server-round"  #: 1-based round number
LOCAL_UPDATE: Final = "local-update"  #: name of the client half to apply
# SecAgg+ (fedadapt.strategies.secagg): what a client needs to encode its update
SECAGG_CLIPPING_RANGE: Final = "secagg-clipping-range"  #: c
SECAGG_QUANTIZATION_RANGE: Final = "secagg-quantization-range"  #: Q
SECAGG_MAX_WEIGHT: Final = "secagg-max-weight"  #: Flower's max_weight
SECAGG_UNIFORM: Final = "secagg-uniform"  #: 1: send weight 1 (uniform ω)
#: B_t: each client clips its update to this L2 norm before masking, and its
#: ‖Δ_i‖² travels as a coordinate of [0, B_t²] (0: no bound this round)
SECAGG_NORM_BOUND: Final = "secagg-norm-bound"
#: JSON {array name: top}: a local update's array (Fed-LAMB's v) travels as
#: the coordinates of [0, top] (missing: as is, within ±c)
SECAGG_LOCAL_RANGES: Final = "secagg-local-ranges"
#: JSON {array name: "ratio" | "log"}: the scale a local-update array's values
#: take before their range applies (fedadapt.strategies.secagg.to_secure_scale;
#: missing: the values themselves); a key ending in * covers every name it starts.
#: A client echoes it in its clear metrics: a reply without the echo (a client
#: that predates the scales sends v unscaled) refuses the secure round
SECAGG_LOCAL_SCALES: Final = "secagg-local-scales"
#: κ and the seed of the round's rotation: under a bound B_t, a client sends
#: its update randomly rotated, each coordinate within ±κ·B_t/√D
#: (fedadapt.strategies.secagg.rotate); absent or κ = 0: not rotated
SECAGG_COORDINATE_BOUND: Final = "secagg-coordinate-bound"
#: num-examples weighting: the most weight a client may send this round
#: (it sends min(num-examples, cap); a larger clear count fails the round)
SECAGG_WEIGHT_CAP: Final = "secagg-weight-cap"
#: 1: append the norm histogram (1 where ‖Δ_i‖ exceeds each of the levels
#: fedadapt.strategies.secagg.norm_levels, else 0) after the clip flag
SECAGG_NORM_HISTOGRAM: Final = "secagg-norm-histogram"
SECAGG_ROTATION_SEED: Final = "secagg-rotation-seed"
#: true: evaluate the received model on the local test split before training
#: and reply with the scores as the MetricRecord :data:`EVALUATE_METRICS`
#: (federated evaluation folded into the train exchange)
EVALUATE_FIRST: Final = "evaluate-first"

# a train reply's second MetricRecord when the config asked EVALUATE_FIRST:
# the received model's evaluation, kept apart from the train metrics
EVALUATE_METRICS: Final = "evaluate-metrics"

# entries of a client's metrics
NUM_EXAMPLES: Final = "num-examples"  #: weight of the reply (Flower's key)
UPDATE_SQ_NORM: Final = "update-sq-norm"  #: ‖x_i − x_t‖² over trainable arrays
#: SecAgg+: coordinates the client's scaled arrays have beyond ±c (0: none)
SECAGG_CLIPPED: Final = "secagg-clipped"
#: SecAgg+: 1 when the client held its local-update arrays (Fed-LAMB's v) to
#: the ranges the server sent, cutting some coordinate (a diagnostic)
SECAGG_LOCAL_CLIPPED: Final = "secagg-local-clipped"
#: SecAgg+: JSON list of the indices of the arrays sent rotated, as one block
SECAGG_ROTATED: Final = "secagg-rotated"
LOCAL_STATE_RESET: Final = "local-update-state-reset"  #: 1: unusable state reset

# a node's answer to the server's query message (seeded sampling), also
# its node-config keys
PARTITION_ID: Final = "partition-id"
NUM_PARTITIONS: Final = "num-partitions"
#: node-config key: the node's own data on disk (fedadapt.tasks.node_data)
DATA_PATH: Final = "data-path"

# an entry of a client's train metrics for the per-reply records
TRAIN_TIME_S: Final = "train-time-s"  #: client wall seconds for the train message
#: seconds the client's process had existed when it replied: in a deployment
#: (one ``flwr-clientapp`` process per message) the process's start-up
#: (interpreter, imports, data) is this minus ``train-time-s``
PROCESS_AGE_S: Final = "process-age-s"
#: where a simulated client ran: the first 48 bits of its Ray node id, as an
#: integer (metrics are numbers); clients.jsonl writes it back as 12 hex digits
RAY_NODE: Final = "ray-node"
#: the device a client trained on: -1 = CPU, k = CUDA device k (of those the
#: ClientApp's process sees); clients.jsonl writes it back as "cpu" / "cuda:k"
TRAIN_DEVICE: Final = "train-device"

#: metrics that describe one reply (who sent it, how long it took): kept in
#: the per-reply records, left out of the round's aggregated metrics (an
#: average partition id means nothing; timings would make the aggregate,
#: which a resumed run reproduces exactly, differ from run to run)
PER_REPLY: Final = (
    PARTITION_ID,
    NUM_PARTITIONS,
    TRAIN_TIME_S,
    PROCESS_AGE_S,
    RAY_NODE,
    TRAIN_DEVICE,
)


def without_per_reply(metrics: Mapping[str, V]) -> dict[str, V]:
    """Return ``metrics`` without the :data:`PER_REPLY` keys."""
    return {k: v for k, v in metrics.items() if k not in PER_REPLY}
