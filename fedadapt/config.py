"""Run-config schema: the one place that defines every run-config key.

Flower only accepts ``--run-config`` overrides for keys listed in
``[tool.flwr.app.config]`` of ``pyproject.toml``. That table and the README's
configuration table are *generated* from :data:`RUN_CONFIG` below
(``python -m fedadapt.config --write``), and a test fails when they drift.

:func:`validate_run_config` checks a run config (unknown keys, types, ranges,
registry names) and raises :class:`ConfigError` naming the key and the valid
values. The ServerApp calls it before any training starts.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedadapt.errors import ConfigError
from fedadapt.strategies import ALGORITHMS, Algorithm, Param
from fedadapt.strategies.core.robust import DEFAULT_NUM_HOSTILE, required_replies
from fedadapt.strategies.local_update import LOCAL_UPDATES, secure_problem

__all__ = [
    "KEYS",
    "RUN_CONFIG",
    "ConfigError",
    "Key",
    "RunConfig",
    "validate_run_config",
]

Scalar = bool | int | float | str
#: A validated run config: every key of :data:`RUN_CONFIG`, each value of
#: its key's type (checked at run time, so typed loosely here).
RunConfig = dict[str, Any]


def _registry_names(kind: str) -> Callable[[], list[str]]:
    """Return a lazy lookup of a registry's names (avoids import cycles)."""

    def names() -> list[str]:
        from fedadapt import registry

        return registry.names(kind)

    return names


def _with_auto(names: Callable[[], list[str]]) -> Callable[[], list[str]]:
    """Return ``names`` with ``auto`` (resolved by validate_run_config) first."""
    return lambda: ["auto", *names()]


@dataclass(frozen=True)
class Key:
    """One run-config key: default, meaning and the values it accepts."""

    name: str
    default: Scalar
    help: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    choices: Callable[[], list[str]] | tuple[str, ...] | None = None

    def valid_choices(self) -> list[str] | None:
        """Return the accepted names, or None when any value of the type is ok."""
        if self.choices is None:
            return None
        return list(self.choices()) if callable(self.choices) else list(self.choices)

    def check(self, value: Any) -> Scalar:
        """Return ``value`` converted to this key's type, or raise ConfigError."""
        kind = type(self.default)
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(self.name, f"expected true or false, got {value!r}")
            return value
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(self.name, f"expected an integer, got {value!r}")
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(self.name, f"expected a number, got {value!r}")
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(self.name, f"expected a finite number, got {value!r}")
        elif not isinstance(value, str):
            raise ConfigError(self.name, f"expected a string, got {value!r}")
        if self.minimum is not None:
            too_small = (
                value <= self.minimum
                if self.exclusive_minimum
                else value < self.minimum
            )
            if too_small:
                bound = ">" if self.exclusive_minimum else ">="
                raise ConfigError(
                    self.name, f"must be {bound} {self.minimum:g}, got {value!r}"
                )
        if self.maximum is not None:
            too_large = (
                value >= self.maximum
                if self.exclusive_maximum
                else value > self.maximum
            )
            if too_large:
                bound = "<" if self.exclusive_maximum else "<="
                raise ConfigError(
                    self.name, f"must be {bound} {self.maximum:g}, got {value!r}"
                )
        choices = self.valid_choices()
        if choices is not None and value not in choices:
            raise ConfigError(
                self.name,
                f"unknown value {value!r}. Valid values: {', '.join(choices)}",
            )
        return value


_APP_KEYS: tuple[Key, ...] = (
    Key("task", "digits-mlp", "Dataset + model + loss (see Tasks).",
        choices=_registry_names("task")),
    Key("strategy", "fedavg", "Server strategy; its hyperparameters are the "
        "`<strategy>.*` keys below.", choices=tuple(ALGORITHMS.names())),
    Key("client-optimizer", "auto", "Optimizer of local training; auto = the "
        "strategy's own (fed-lamb for strategy fed-lamb, which needs a client that "
        "sends second moments; sgd for every other).",
        choices=_with_auto(_registry_names("client-optimizer"))),
    Key("local-update", "none", "An algorithm's client-side part, with any "
        "strategy: none (plain local training), fedprox (proximal term "
        "(μ/2)‖w − w_t‖², Li et al. 2020), moon (model-contrastive loss, Li, "
        "He and Song 2021), scaffold (control variates, option II, Karimireddy "
        "et al. 2020b; η_g is the strategy's server step), mime or mimelite "
        "(local steps with the server's SGDm momentum, Karimireddy et al. 2020a; "
        "client-optimizer=sgd); its hyperparameters are the `<local-update>.*` "
        "keys.", choices=_registry_names("local-update")),
    Key("data-dir", "data", "Folder with the datasets in their standard on-disk "
        "formats (nothing is downloaded); use an absolute path."),
    Key("augment", True, "Train-time augmentation of CIFAR tasks (random crop + "
        "flip, as the Δ-SGD code)."),
    Key("partition", "dirichlet", "How the training set is split over clients.",
        choices=_registry_names("partition")),
    Key("dirichlet-alpha", 0.5, "Concentration α of the Dirichlet label partition "
        "(smaller = more skew).", minimum=0.0, exclusive_minimum=True),
    Key("classes-per-client", 2, "Classes per client of partition=shards (1 = "
        "Fed-LAMB's one digit per device).", minimum=1),
    Key("samples-per-client", 500, "Samples per client of partition=delta-sgd "
        "(drawn with replacement).", minimum=1),
    Key("num-server-rounds", 20, "Number of federated rounds.", minimum=1),
    Key("stop-metric", "", "End the run early on this metric: looked up per round "
        "in the central evaluation (loss, accuracy), else the federated one "
        "(eval-loss, eval-accuracy), else the train metrics (train-loss, "
        "train-accuracy); results.json says why the run ended (stop_reason). "
        "Empty = run all rounds."),
    Key("stop-mode", "max", "Whether larger (max: accuracy) or smaller (min: loss) "
        "values of stop-metric are better.", choices=("max", "min")),
    Key("stop-target", 0.0, "Stop once stop-metric reaches this value; 0 = off."),
    Key("stop-patience", 0, "Stop after this many evaluations of stop-metric in a "
        "row without improvement; 0 = off.", minimum=0),
    Key("stop-min-delta", 0.0, "Smallest change of stop-metric that counts as an "
        "improvement.", minimum=0.0),
    Key("clients-per-round", 0, "Clients sampled for training each round; 0 = "
        "every connected node (Flower's fraction-train = 1). A number larger than "
        "the federation fails at start.", minimum=0),
    Key("clients-per-eval", 0, "Clients sampled for federated evaluation on their "
        "local test split each round (0 = off); with federated-eval-exchange "
        "with-train the round's training clients evaluate instead, and this "
        "many score the final model.", minimum=0),
    Key("federated-eval-exchange", "auto", "How federated evaluation "
        "(clients-per-eval > 0) reaches the clients. with-train: each train "
        "message asks its client to evaluate the received model before training "
        "and reply with both, one exchange a round (round t's federated_eval "
        "scores round t−1's model, its model-round; one evaluate exchange after "
        "the last round scores the final model: final_federated_eval). separate: "
        "an evaluate exchange after each round's training, two a round. auto: "
        "with-train in deployment, separate in simulation. Message-API ServerApp "
        "only (the legacy one: separate); not with average-last-two (auto: "
        "separate).", choices=("auto", "with-train", "separate")),
    Key("evaluate-every", 1, "Central evaluation of the global model on the task's "
        "test set every N rounds (0 = off: the server loads no data).", minimum=0),
    Key("central-data-path", "", "Central evaluation on this server-side dataset "
        "(its test split, else all of it; npz, Hugging Face save_to_disk or image "
        "folder, as a node's data-path) instead of the task's test set; empty = "
        "the task's test set. An absolute path."),
    Key("local-epochs", 2, "Local epochs per round (used when local-steps = 0).",
        minimum=0),
    Key("local-steps", 0, "Local optimizer steps per round; overrides local-epochs "
        "when > 0.", minimum=0),
    Key("batch-size", 32, "Local mini-batch size.", minimum=1),
    Key("delta-sgd-gamma", 2.0, "Δ-SGD amplifier γ of the smoothness term.",
        minimum=0.0, exclusive_minimum=True),
    Key("delta-sgd-delta", 0.1, "Δ-SGD growth factor δ.", minimum=0.0),
    Key("client-beta-1", 0.9, "β1 of the client optimizers adam, fed-lamb, fed-ams.",
        minimum=0.0, maximum=0.999),
    Key("client-beta-2", 0.999, "β2 of the client optimizers adam, fed-lamb, "
        "fed-ams.", minimum=0.0, maximum=0.99999),
    Key("fed-lamb-lambda", 0.01, "Fed-LAMB weight decay λ.", minimum=0.0),
    Key("client-lr", 0.0, "Client learning rate η_l (η0 for Δ-SGD); 0: the "
        "client optimizer's default (fed-lamb 0.03, fed-ams 0.0003, the others "
        "0.1).", minimum=0.0),
    Key("client-lr-decay", 1.0, "Client learning rate decay per round: round t "
        "trains with client-lr·decay^(t−1) (DUA/FedExP image tasks: 0.998).",
        minimum=0.0, maximum=1.0, exclusive_minimum=True),
    Key("client-lr-schedule", "constant", "Client learning rate schedule over the "
        "rounds, on top of client-lr-decay: constant, or step (the Δ-SGD paper's ↓ "
        "baselines: divided by 10 from round ⌊T/2⌋+1 on and again from ⌊3T/4⌋+1, "
        "T = num-server-rounds).", choices=("constant", "step")),
    Key("client-weight-decay", 0.0, "L2 weight decay λ of local training: every "
        "gradient gets + λ·x (DUA/FedExP image tasks: 1e-4).", minimum=0.0),
    Key("client-grad-clip", 0.0, "Clip each local loss gradient to this L2 norm "
        "(over all parameters, before weight decay); 0 = off (DUA/FedExP image "
        "tasks: 10).", minimum=0.0),
)  # fmt: skip
_RUN_KEYS: tuple[Key, ...] = (
    Key("secure-aggregation", "off", "off: the server sees each update, computes "
        "each norm itself and counts mismatching reports. secagg+ (or true): "
        "Flower's SecAgg+ masks each client's update and ‖Δ_i‖², the server "
        "steps on their sums only (through Flower's legacy API, which alone has "
        "SecAgg+: the default apps hand such runs to the legacy ones; secagg-* "
        "keys; docs/secure-aggregation.md). trust-reported-norms (what "
        "true meant before issue #41; nothing is masked): fedexp/feddua use the "
        "clients' reported update-sq-norm as given and reject (counted) replies "
        "without one. Per-client defences are off in both (under secagg+ the "
        "clients clip to a bound the server sends).",
        choices=("off", "secagg+", "trust-reported-norms")),
    Key("secagg-clipping-range", 8.0, "SecAgg+: c, each client's scaled update "
        "coordinates and ‖Δ_i‖² must lie in ±c (a client beyond it fails the "
        "round, never a silently clipped sum).", minimum=0.0,
        exclusive_minimum=True),
    Key("secagg-quantization-range", 4194304, "SecAgg+: Q, values are quantised "
        "to integers in [0, Q] (step 2c/Q; the error of each coordinate of the "
        "sums is below clients · 2c/Q / Σ weights, 2c/Q when uniform).",
        minimum=1, maximum=2**31 - 1),
    Key("secagg-modulus-range", 4294967296, "SecAgg+: M, a power of two; the "
        "masked sum is exact for up to (M − 1) // Q clients per round.",
        minimum=2, maximum=2**62),
    Key("secagg-coordinate-bound", 1.0, "SecAgg+: κ; under the round's norm "
        "bound B each client sends its update randomly rotated with every "
        "coordinate within ±κ·B/√D, so no reply (honest or not) carries more "
        "than κ·B. At κ = 1 an update at the median norm (B/2) is perturbed by "
        "about 11 % of its norm, one at B by about 39 % (2: 1 % and 11 %; "
        "docs/robustness.md measures both). 0 = not rotated (a hostile update is "
        "then bounded only by Jensen's check on the sums).", minimum=0.0),
    Key("secagg-step-guard", False, "SecAgg+, FedExP/FedExPM/FedDuA: cap the "
        "server step at the worst case of any one client removed, from the bounds "
        "each reply is held to (κ·B in L2, B² for its norm): no client can raise "
        "the extrapolation, but honest runs lose 3–12 accuracy points on "
        "digits-mlp (docs/robustness.md), so it is off."),
    Key("secagg-max-weight", 1000.0, "SecAgg+ with num-examples weighting: "
        "Flower's max_weight, at least every client's num-examples (uniform "
        "weighting sends weight 1 and uses 1).", minimum=0.0,
        exclusive_minimum=True),
    Key("secagg-num-shares", 1.0, "SecAgg+: secret shares per client as a "
        "fraction of the round's clients (Flower's num_shares).", minimum=0.0,
        maximum=1.0, exclusive_minimum=True),
    Key("secagg-reconstruction-threshold", 0.5, "SecAgg+: fraction of the "
        "shares needed to unmask (Flower's reconstruction_threshold; at least 2).",
        minimum=0.0, maximum=1.0, exclusive_minimum=True),
    Key("max-update-norm", 0.0, "Clip each client's update to this L2 norm before "
        "aggregation (counted as clipped); 0 = off. Under secagg+ the clients "
        "clip to it; not with trust-reported-norms.",
        minimum=0.0),
    Key("max-update-norm-ratio", 2.0, "Norm bounding: a client update above this "
        "multiple k of the round's median client update norm is clipped to k × "
        "that median before aggregation (norm-bound-mode=clip: no client weighs "
        "more than k typical ones; counted as clipped, bound in the round's "
        "strategy diagnostics); 0 = off. Under secagg+ (the server sees only "
        "sums) each client clips to k × the previous round's median update "
        "norm, from a norm histogram in the masked sums, sent by the server "
        "(round 1 then only measures it, unless max-update-norm is set); off "
        "with trust-reported-norms. docs/robustness.md.", minimum=0.0),
    Key("norm-bound-mode", "clip", "What norm bounding does above its bound: clip "
        "(to the bound) or flag (scale to the median norm of the other updates; "
        "the default before issue #38, which a client just under the bound "
        "defeats).", choices=("clip", "flag")),
    Key("max-weight-ratio", 2.0, "Cap on a reply's num-examples, as a multiple of "
        "the round's median count, before weighting (a count is the client's "
        "claim); 0 = off. Only under num-examples weighting.", minimum=0.0),
    Key("max-contribution-ratio", 2.0, "Cap on a reply's pull on the mean update "
        "(its weight times its clipped update norm), as a multiple of the round's "
        "median pull; above it the update is scaled down (counted as clipped). "
        "The norm bound and the weight cap alone let one client pull like 4 "
        "typical ones. 0 = off; adds nothing under uniform weighting; inactive "
        "with secure-aggregation and robust aggregation (also the one "
        "aggregation=auto picks: fedadam, fedavgm, fedexp, feddua adagrad in "
        "rounds of 5 or more). docs/robustness.md.",
        minimum=0.0),
    Key("max-update-norm-growth", 3.0, "Ceiling on every update's norm, as a "
        "multiple of the first round's median update norm (kept in checkpoints); "
        "above it the update is clipped (counted as clipped, ceiling in the "
        "round's strategy diagnostics). Every other bound follows its own round, "
        "so a federation whose updates keep growing (three colluders of ten made "
        "FedExP(M) and FedDuA diverge so) is held to it. 0 = off. Under secagg+ it "
        "caps the bound the clients clip to; off with trust-reported-norms. "
        "docs/robustness.md.", minimum=0.0),
    Key("project-opposing", False, "Remove from each update its component "
        "against the weighted mean of the other updates, where it has one: no "
        "client pulls the round back along what the others agree on (sign flip, "
        "inner-product manipulation; on non-IID digits FedAvg's loss to a sign "
        "flip 12.8 -> 5.4 points). Off by default: where clients hold one class "
        "each, honest updates oppose one another and it moved honest runs by up "
        "to 6 points. clients.jsonl has each reply's consensus_cos. Inactive with "
        "secure-aggregation and a robust aggregation written out; turned on, it "
        "makes aggregation=auto the mean. docs/robustness.md."),
    Key("validation-size", 0, "Influence screen (RONI, reject on negative "
        "influence): the server holds this many examples, drawn with the run's seed "
        "from the task's training pool (or validation-data-path), and rejects, one "
        "at a time, a reply whose presence raises their loss under the round's mean "
        "update by more than influence-tolerance. Judges what an update does, not "
        "its size: a client reversing its own update at its own norm and weight "
        "cost FedAvg 8 points on non-IID digits under every bound. 0 = off (it "
        "rejects many honest replies: honest FedExPM lost 0.6 points on mnist5k-cnn, "
        "digits-mlp runs nothing measurable); refused with secure-aggregation and "
        "a robust aggregation written out; turned on, it makes aggregation=auto "
        "the mean. docs/robustness.md.",
        minimum=0),
    Key("influence-tolerance", 0.005, "How much (relative) one reply may raise the "
        "validation loss of the round's aggregate before the influence screen "
        "rejects it (validation-size > 0).", minimum=0.0),
    Key("validation-data-path", "", "The influence screen's validation data: a "
        "server-side dataset (npz, Hugging Face save_to_disk or image folder, as a "
        "node's data-path; its train split) instead of a sample of the task's "
        "training pool; validation-size examples of it are used. An absolute path."),
    Key("step-guard", True, "FedExP/FedExPM/FedDuA: cap the server step size at "
        "the smallest one the round gives without any one client (leave-one-out), "
        "so no single client raises the extrapolation; and use as A (the mean "
        "squared update norm the step grows with) the largest leave-one-out A, so "
        "no single client lowers it with a short update. Inactive with "
        "secure-aggregation and with the robust aggregations other than "
        "centered-clipping; under centered-clipping (what aggregation=auto picks "
        "for fedexp and feddua adagrad in rounds of 5 or more, with num-hostile "
        "up to 2) each client is left out of the mean of clipped updates, same "
        "radius and centre."),
    Key("aggregation", "auto", "How the clients' updates form the Δ̄ the strategy "
        "steps on: auto (the strategy's robust aggregator, in rounds of 2 "
        "num-hostile + 3 replies or more: multi-krum for fedadam, "
        "centered-clipping for fedexp, feddua's adagrad variant and fed-lamb, "
        "trimmed-mean cutting num-hostile values at each end for fedavgm; "
        "else the mean; trimmed-mean cutting num-hostile values at each end for "
        "every strategy with num-hostile 2 or more on the mean and multi-krum, "
        "3 or more on centered-clipping; with secure-aggregation, "
        "validation-size or project-opposing the mean; "
        "docs/robustness.md), mean (weighted, the papers), median or trimmed-mean "
        "(coordinate-wise, unweighted, as Flower's FedMedian / FedTrimmedAvg), "
        "krum, multi-krum or bulyan (keep the updates nearest the others, "
        "Blanchard et al. 2017, El Mhamdi et al. 2018, as Flower's Krum / "
        "MultiKrum / Bulyan; num-hostile), centered-clipping (clip each update's "
        "distance to the previous round's Δ̄, Karimireddy et al. 2021; "
        "clip-radius, clip-iterations). The robust ones not with "
        "secure-aggregation.",
        choices=("auto", "mean", "median", "trimmed-mean", "krum", "multi-krum",
                 "bulyan", "centered-clipping")),
    Key("trim-fraction", 0.2, "Fraction of the values cut at each end per "
        "coordinate by aggregation=trimmed-mean (Flower's FedTrimmedAvg beta), "
        "below 0.5 (aggregation=auto's trimmed mean, fedavgm's and every "
        "strategy's told num-hostile 2 or more, cuts num-hostile values at each "
        "end instead).",
        minimum=0.0, maximum=0.49),
    Key("num-hostile", 1, "f, the hostile clients per round aggregation=krum, "
        "multi-krum and bulyan assume (Flower's num_malicious_clients). Krum needs "
        "2f + 3 replies, Bulyan 4f + 3; a round with fewer uses the largest f it "
        "allows (warned; under 3 replies the coordinate-wise median). With "
        "aggregation=auto it also picks the aggregator (see aggregation).",
        minimum=0),
    Key("krum-keep", 0, "m, the updates aggregation=multi-krum averages (weighted "
        "as the strategy's mean); 0 = n − f of the round.", minimum=0),
    Key("clip-radius", 0.0, "τ of aggregation=centered-clipping: each client's "
        "Δ_i − v is clipped to this L2 norm; 0 = the round's median ‖Δ_i − v‖ "
        "(adaptive).", minimum=0.0),
    Key("clip-iterations", 1, "L, the clipping iterations per round of "
        "aggregation=centered-clipping.", minimum=1),
    Key("max-failed-rounds", 3, "Stop the run (status failed, client errors in "
        "the log) after this many consecutive rounds without a usable train reply; "
        "0 = never.", minimum=0),
    Key("checkpoint-every", 1, "Save global model + strategy state every N rounds "
        "(and after the last) to <run>/checkpoint.pkl, replacing the last one "
        "atomically; 0 = never. `fedadapt simulate --resume <run folder>` "
        "continues from it (cost: docs/benchmarks.md).", minimum=0),
    Key("resume-from", "", "Checkpoint file to resume from (same task and "
        "strategy); the run continues to num-server-rounds."),
    Key("client-test-fraction", 0.2, "Share of each client's data held out for "
        "federated evaluation.", minimum=0.0, maximum=0.9),
    Key("seed", 0, "Seed of model initialisation, partition, local shuffling and "
        "client sampling.", minimum=0),
    Key("seeded-sampling", True, "Sample clients with an RNG seeded by `seed` over "
        "the nodes ordered by partition-id (asked at start until every node "
        "answered; the run fails if one has not within round-timeout), so "
        "reruns train the same clients; false = Flower's unseeded sampling."),
    Key("device", "auto", "Client training device: auto (CUDA if visible), cpu, cuda.",
        choices=("auto", "cpu", "cuda")),
    Key("client-worker", "auto", "Where a deployment's client work runs. auto: "
        "Flower starts a new flwr-clientapp process for every message; it imports "
        "Flower only and hands the message to the node's warm worker, which keeps "
        "torch, CUDA and the node's data loaded between messages and ends with its "
        "SuperNode or after 10 idle minutes (simulations and in-process runs are "
        "warm already and do not use one). off: every message's process does the "
        "work itself.", choices=("auto", "off")),
    Key("output-dir", "outputs", "Where run folders are written; use an absolute "
        "path (the ServerApp runs in the SuperLink's working directory)."),
    Key("run-name", "", "Run folder name; empty = <time>-<task>-<strategy>-<run id>."),
    Key("overwrite", False, "Replace a finished run (completed/failed/stopped) in "
        "the run folder; false = a run-name whose folder holds a run fails at "
        "start. A live run's folder is never taken (docs/failures.md)."),
    Key("tracker", "none", "Experiment tracker that also receives every round's "
        "record (metrics, reply counts, strategy diagnostics, wall time) and the run "
        "config: none, tensorboard, wandb (offline), mlflow (local SQLite store). Each "
        "needs its extra: pip install 'fedadapt[tensorboard]' (docs/trackers.md).",
        choices=("none", "tensorboard", "wandb", "mlflow")),
    Key("tracker-dir", "", "Where the tracker writes; empty = <run folder>/tracker. "
        "Use an absolute path (as output-dir) to collect several runs in one place."),
    Key("tracker-group", "", "Group of tracked runs (fedadapt-exp: the suite): "
        "TensorBoard subfolder, W&B group, MLflow experiment (empty = fedadapt)."),
    Key("node-wait-timeout", 120.0, "Deployment: seconds the ServerApp waits at "
        "start for clients-per-round nodes (at least one) to connect; a simulation "
        "knows its size and does not wait.", minimum=0.0),
    Key("round-timeout", 3600.0, "Seconds to wait for the replies of one round "
        "(and, with seeded-sampling, for every node's partition-id at start).",
        minimum=0.0, exclusive_minimum=True),
)  # fmt: skip


def _strategy_key(owner: Any, param: Param) -> Key:
    """Return the run-config key of one declared hyperparameter.

    ``owner`` is an :class:`Algorithm` or a local update's server half
    (:class:`~fedadapt.strategies.local_update.LocalUpdate` subclass): both
    name the key ``<name>.<param>`` (``owner.key``).
    """
    title = owner.title if isinstance(owner, Algorithm) else owner.__name__
    return Key(
        owner.key(param), param.default,
        f"{title}: {param.doc} Default: {param.source}.",
        minimum=param.low, maximum=param.high, exclusive_minimum=param.low_open,
        exclusive_maximum=param.high_open, choices=param.choices,
    )  # fmt: skip


#: ``<strategy>.<param>`` keys, generated from the algorithms' declarations
STRATEGY_KEYS: tuple[Key, ...] = tuple(
    _strategy_key(algorithm, param)
    for algorithm in (ALGORITHMS.get(n) for n in ALGORITHMS.names())
    for param in algorithm.params
)
#: ``<local-update>.<param>`` keys, generated from the server halves' params
LOCAL_UPDATE_KEYS: tuple[Key, ...] = tuple(
    _strategy_key(update, param)
    for update in (LOCAL_UPDATES.get(n) for n in LOCAL_UPDATES.names())
    for param in update.params
)
# the keys above are built once: a later registration would be silently
# unselectable (and missing from pyproject's table), so it raises instead
ALGORITHMS.freeze("fedadapt.config has built the run-config keys")
LOCAL_UPDATES.freeze("fedadapt.config has built the run-config keys")
RUN_CONFIG: tuple[Key, ...] = (
    *_APP_KEYS,
    *STRATEGY_KEYS,
    *LOCAL_UPDATE_KEYS,
    *_RUN_KEYS,
)
KEYS: dict[str, Key] = {key.name: key for key in RUN_CONFIG}
#: Shared strategy keys before #28 → the parameter that replaced each
#: (its key is ``<strategy>.<param>`` for the strategies that declare it)
_RENAMED = {
    "server-lr": ("eta", "server_learning_rate"),
    "server-momentum": ("server_momentum",),
    "beta-1": ("beta_1",),
    "beta-2": ("beta_2",),
    "tau": ("tau",),
    "epsilon": ("epsilon",),
    "epsilon-g": ("epsilon_g", "epsilon"),
    "feddua-variant": ("variant",),
    "fedexp-form": ("form",),
    "bias-correction": ("bias_correction",),
    "average-last-two": ("average_last_two",),
    "weighting": ("weighting",),
}
#: bool values keys took before they became strings → their new value
#: (``secure-aggregation = true`` meant trusting reported norms before issue
#: #41; it now selects real SecAgg+, "trust-reported-norms" is the old mode)
_BOOL_VALUES: dict[str, dict[bool, str]] = {
    "secure-aggregation": {False: "off", True: "secagg+"},
}
#: client optimizers whose second moments only the fed-lamb strategy handles
SECOND_MOMENT_OPTIMIZERS = ("fed-lamb", "fed-ams")
#: ``client-lr`` 0: the client optimizer's own default, else this one.
DEFAULT_CLIENT_LR = 0.1
#: The optimizers whose step SGD's 0.1 makes diverge (issue #38's suite,
#: 2–3 seeds, digits-mlp 20 rounds and mnist5k-cnn 10: at 0.1 Fed-LAMB ends
#: mnist5k-cnn at chance in every run, Fed-AMS both tasks). The spec's
#: defaults are 1e-2 and 1e-3 (algorithms-spec, Fed-LAMB table: "tune over
#: {1e-4, 3e-4, …, 1e-1}"); we take the rate of that grid that trains on
#: both tasks. Fed-LAMB 3e-2: digits-mlp 94.1 % (1e-2: 84.6, 1e-1: 91.9),
#: mnist5k-cnn 94.7 % (89.7, 10.0). Fed-AMS 3e-4: digits-mlp 87.6 % (1e-3:
#: 93.3, 1e-4 not run), mnist5k-cnn 88.0 % (1e-3 and above: chance in every
#: run, 1e-4: 78.4). The CNN's divergence: Fed-AMS does not bias-correct v
#: (LAMB Algorithm 1), so its first step is α/√(1−β2) ≈ 32·α in every
#: coordinate (measured: benchmarks/fed_ams_first_steps.py); with v
#: corrected, 1e-3 no longer ends at chance but reaches 77.5 %, below 3e-4's
#: 88.0. The trust ratio of Fed-LAMB normalises those steps per layer.
OPTIMIZER_CLIENT_LR = {"fed-lamb": 0.03, "fed-ams": 0.0003}


#: ``client-optimizer`` auto: the strategy's own client optimizer, else sgd.
#: Fed-LAMB's server averages the clients' second moments, so only a client
#: that sends them (fed-lamb, fed-ams) can serve it; fed-lamb is the paper's.
STRATEGY_CLIENT_OPTIMIZER = {"fed-lamb": "fed-lamb"}
DEFAULT_CLIENT_OPTIMIZER = "sgd"


def client_optimizer(config: Mapping[str, Any]) -> str:
    """Return the client optimizer of ``config``.

    ``client-optimizer`` as given, or for ``auto`` the strategy's own
    (:data:`STRATEGY_CLIENT_OPTIMIZER`, else :data:`DEFAULT_CLIENT_OPTIMIZER`).
    """
    given = str(config["client-optimizer"])
    if given != "auto":
        return given
    strategy = str(config["strategy"])
    return STRATEGY_CLIENT_OPTIMIZER.get(strategy, DEFAULT_CLIENT_OPTIMIZER)


def client_lr(config: Mapping[str, Any]) -> float:
    """Return the client learning rate of ``config``.

    ``client-lr`` as given, or for 0 the client optimizer's default
    (:data:`OPTIMIZER_CLIENT_LR`, else :data:`DEFAULT_CLIENT_LR`).
    """
    given = float(config["client-lr"])
    if given > 0:
        return given
    return OPTIMIZER_CLIENT_LR.get(str(config["client-optimizer"]), DEFAULT_CLIENT_LR)


def defaults() -> dict[str, Scalar]:
    """Return the default run config (what ``pyproject.toml`` declares)."""
    return {key.name: key.default for key in RUN_CONFIG}


def validate_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """Check ``run_config`` and return a complete, typed copy.

    Missing keys take their defaults; unknown keys, wrong types, out-of-range
    values and unknown registry names raise :class:`ConfigError`.
    """
    unknown = sorted(set(run_config) - set(KEYS))
    if unknown:
        raise ConfigError(unknown[0], _unknown_key_message(unknown[0]))
    config: RunConfig = defaults()
    for name, value in run_config.items():
        if isinstance(value, bool) and name in _BOOL_VALUES:
            value = _BOOL_VALUES[name][value]
        config[name] = KEYS[name].check(value)
    _check_strategy_keys(config)
    chosen_by_auto = config["client-optimizer"] == "auto"
    config["client-optimizer"] = client_optimizer(config)
    _check_local_update_optimizer(config, chosen_by_auto)
    config["client-lr"] = client_lr(config)
    if config["local-epochs"] == 0 and config["local-steps"] == 0:
        raise ConfigError(
            "local-epochs", "local-epochs and local-steps are both 0: no local work"
        )
    moments_client = config["client-optimizer"] in SECOND_MOMENT_OPTIMIZERS
    if moments_client != (config["strategy"] == "fed-lamb"):
        raise ConfigError(
            "strategy",
            "client optimizers fed-lamb and fed-ams exchange second moments with "
            "strategy fed-lamb and need each other (client-optimizer=auto picks "
            "fed-lamb for it); got strategy="
            f"{config['strategy']!r}, client-optimizer={config['client-optimizer']!r}",
        )
    _check_secure_aggregation(config)
    trusting = config["secure-aggregation"] == "trust-reported-norms"
    if trusting and config["max-update-norm"] > 0:
        raise ConfigError(
            "max-update-norm",
            "clipping needs the server's own norms, or secagg+ (the clients clip "
            "to it); trust-reported-norms has neither",
        )
    stop_rules = config["stop-target"] != 0 or config["stop-patience"] > 0
    if config["stop-metric"] and not stop_rules:
        raise ConfigError(
            "stop-metric", "set stop-target or stop-patience (else it never stops)"
        )
    if stop_rules and not config["stop-metric"]:
        raise ConfigError(
            "stop-metric", "stop-target and stop-patience need the metric to watch"
        )
    _check_stop_metric_is_reported(config)
    robust = config["aggregation"] not in ("auto", "mean")
    if config["secure-aggregation"] != "off" and robust:
        raise ConfigError(
            "aggregation",
            f"{config['aggregation']} needs the individual updates; with "
            "secure-aggregation only their sum is known: use mean",
        )
    _check_robust_aggregation(config)
    if config["clients-per-eval"] > 0 and config["client-test-fraction"] == 0:
        raise ConfigError(
            "clients-per-eval",
            "federated evaluation needs a local test split (client-test-fraction > 0)",
        )
    return config


def _check_secure_aggregation(config: RunConfig) -> None:
    """Refuse SecAgg+ settings that cannot give an exact sum, or cannot run."""
    if config["secure-aggregation"] != "secagg+":
        return
    q, m = config["secagg-quantization-range"], config["secagg-modulus-range"]
    if m & (m - 1) or m <= q:
        raise ConfigError(
            "secagg-modulus-range",
            f"must be a power of two above secagg-quantization-range ({q}), got {m}",
        )
    per_round = config["clients-per-round"]
    if per_round and per_round * q >= m:
        raise ConfigError(
            "secagg-quantization-range",
            f"{per_round} clients × Q = {q} reach M = {m}: the masked sum would "
            "wrap; lower it or raise secagg-modulus-range",
        )
    own = ALGORITHMS.get(config["strategy"]).local_update
    kinds = [LOCAL_UPDATES.get(config["local-update"])]
    kinds += [] if own is None else [own]
    weighting_key = f"{config['strategy']}.weighting"
    problem = secure_problem(kinds, config.get(weighting_key, "uniform"))
    if problem is not None:
        raise ConfigError(
            weighting_key if "weighting" in problem else "secure-aggregation",
            f"secagg+ masks the update, its norm and arrays whose mean is all the "
            f"server needs: {problem}",
        )


def _unknown_key_message(key: str) -> str:
    """Say which key replaced a renamed one, else list the valid keys."""
    if key in _RENAMED:
        params = _RENAMED[key]
        new = [
            k.name
            for k in STRATEGY_KEYS
            if k.name.split(".", 1)[1].replace("-", "_") in params
        ]
        return (
            f"unknown key: {key} is now <strategy>.{params[0].replace('_', '-')} "
            f"(one key per strategy that has it: {', '.join(new)})"
        )
    return f"unknown key. Valid keys: {', '.join(sorted(KEYS))}"


def _check_strategy_keys(config: RunConfig) -> None:
    """Refuse another strategy's (local update's) key set away from its default.

    It would do nothing, silently. (Flower passes every key of pyproject's
    table, so only a changed value shows that a user set it.)
    """
    for selector, keys in (
        ("strategy", STRATEGY_KEYS),
        ("local-update", LOCAL_UPDATE_KEYS),
    ):
        prefix = config[selector] + "."
        for key in keys:
            if key.name.startswith(prefix) or config[key.name] == key.default:
                continue
            raise ConfigError(
                key.name,
                f"set to {config[key.name]!r}, but {selector}={config[selector]!r} "
                f"does not read it (only {prefix}* keys); remove it or set "
                f"{selector}={key.name.split('.', 1)[0]!r}",
            )


def _check_robust_aggregation(config: RunConfig) -> None:
    """Refuse Krum/Bulyan settings that no round of this size can meet.

    With ``clients-per-round`` fixed, every round would silently fall back
    to a smaller f (or multi-Krum to fewer updates); a round that loses
    replies still does, with a warning.
    """
    name, per_round = config["aggregation"], config["clients-per-round"]
    hostile = config["num-hostile"]
    judged = (
        config["secure-aggregation"] == "off"
        and config["validation-size"] == 0
        and not config["project-opposing"]
    )  # else auto is the mean whatever f, and f is the quarantine's limit
    asked = hostile > DEFAULT_NUM_HOSTILE
    need = required_replies("krum", hostile)
    if name == "auto" and asked and judged and 0 < per_round < need:
        raise ConfigError(
            "num-hostile",
            f"aggregation=auto withstands num-hostile={hostile} in rounds of at "
            f"least {need} replies, but clients-per-round={per_round}: every "
            "round would run the plain mean; lower num-hostile or raise "
            "clients-per-round",
        )
    if name not in ("krum", "multi-krum", "bulyan") or per_round == 0:
        return
    need = required_replies(name.replace("-", "_"), hostile)
    if per_round < need:
        raise ConfigError(
            "num-hostile",
            f"aggregation={name} with num-hostile={hostile} needs at least {need} "
            f"replies per round, but clients-per-round={per_round}; lower "
            "num-hostile or raise clients-per-round",
        )
    keep = config["krum-keep"]
    if name == "multi-krum" and keep > per_round - hostile:
        raise ConfigError(
            "krum-keep",
            f"{keep} updates to average, but a round has at most "
            f"clients-per-round − num-hostile = {per_round - hostile} to keep",
        )


def _check_local_update_optimizer(config: RunConfig, chosen_by_auto: bool) -> None:
    """Refuse a client optimizer the selected local update does not work with.

    ``chosen_by_auto``: the user left ``client-optimizer`` at ``auto`` and the
    strategy picked it; the message then says so, since the user never named it.
    """
    name = config["local-update"]
    allowed = LOCAL_UPDATES.get(name).client_optimizers
    optimizer = config["client-optimizer"]
    if allowed is not None and optimizer not in allowed:
        got = (
            f"strategy={config['strategy']!r} needs its own client optimizer "
            f"{optimizer!r} (client-optimizer=auto picked it)"
            if chosen_by_auto
            else f"got {optimizer!r}"
        )
        raise ConfigError(
            "client-optimizer",
            f"local-update={name!r} sets the local step's direction itself and "
            f"needs client-optimizer in {list(allowed)}; {got}",
        )


def _check_stop_metric_is_reported(config: RunConfig) -> None:
    """Refuse a stop-metric that this run config never evaluates."""
    metric = config["stop-metric"]
    if metric in ("loss", "accuracy") and config["evaluate-every"] == 0:
        raise ConfigError(
            "stop-metric", f"{metric!r} is the central evaluation's, which "
            "evaluate-every=0 turns off",
        )  # fmt: skip
    if metric.startswith("eval-") and config["clients-per-eval"] == 0:
        raise ConfigError(
            "stop-metric", f"{metric!r} comes from federated evaluation, which "
            "clients-per-eval=0 turns off",
        )  # fmt: skip


# --- generated tables -------------------------------------------------------

_TABLE_BEGIN, _TABLE_END = "# BEGIN run-config", "# END run-config"
_MD_BEGIN, _MD_END = "<!-- BEGIN run-config -->", "<!-- END run-config -->"
#: README's strategies table and docs/algorithms.md's papers table
#: (:mod:`fedadapt.reference`, from the declarations)
_STRATEGIES = ("<!-- BEGIN strategies -->", "<!-- END strategies -->")
_PAPERS = ("<!-- BEGIN papers -->", "<!-- END papers -->")


def _toml_value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def render_pyproject_table() -> str:
    """Return the body of ``[tool.flwr.app.config]``."""
    return "\n".join(
        f"{_toml_key(k.name)} = {_toml_value(k.default)}" for k in RUN_CONFIG
    )


def _toml_key(name: str) -> str:
    """Return ``name`` as a TOML key, quoted when dotted (one flat key)."""
    return f'"{name}"' if "." in name else name


def render_markdown_table() -> str:
    """Return the README's configuration table."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key in RUN_CONFIG:
        text = key.help
        choices = key.valid_choices()
        if choices:
            text += " One of: " + ", ".join(f"`{c}`" for c in choices) + "."
        rows.append(f"| `{key.name}` | `{_toml_value(key.default)}` | {text} |")
    return "\n".join(rows)


def _replace_between(text: str, begin: str, end: str, body: str) -> str:
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise RuntimeError(f"markers {begin!r} … {end!r} not found")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def render_task_confs() -> dict[str, str]:
    """Return ``conf/tasks/<task>.toml`` files: each paper's setup as overrides."""
    from fedadapt.registry import lookup

    tasks = lookup("task")
    files = {}
    for name in tasks.names():
        setup = dict(tasks.get(name).paper_config)
        if not setup:
            continue
        nodes = setup.pop("num-supernodes", None)
        lines = [
            f"# {tasks.get(name).summary}",
            "# Generated from fedadapt/tasks (paper_config); edit there.",
            f"# flwr run . <connection> --run-config conf/tasks/{name}.toml "
            f'--federation-config "num-supernodes={nodes}"',
            f'task = "{name}"',
            *(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in setup.items()),
        ]
        files[f"conf/tasks/{name}.toml"] = "\n".join(lines) + "\n"
    return files


def sync_files(root: Path, write: bool) -> list[str]:
    """Regenerate (or, with ``write=False``, check) the generated files.

    pyproject.toml's run-config table, README.md's configuration and
    strategies tables, docs/algorithms.md's papers table,
    ``conf/tasks/*.toml`` and ``docs/strategies-reference.md``
    (:mod:`fedadapt.reference`). Returns the files that were (or would be)
    changed.
    """
    from fedadapt import reference

    targets = [
        ("pyproject.toml", _TABLE_BEGIN, _TABLE_END, render_pyproject_table()),
        ("README.md", _MD_BEGIN, _MD_END, render_markdown_table()),
        ("README.md", *_STRATEGIES, reference.render_strategies_table()),
        ("docs/algorithms.md", *_PAPERS, reference.render_papers_table()),
    ]
    texts: dict[str, str] = {}
    for name, begin, end, body in targets:
        if name not in texts:
            texts[name] = (root / name).read_text(encoding="utf-8")
        texts[name] = _replace_between(texts[name], begin, end, body)
    changed = []
    for name, new in texts.items():
        path = root / name
        if new != path.read_text(encoding="utf-8"):
            changed.append(name)
            if write:
                path.write_text(new, encoding="utf-8")
    generated = {**render_task_confs(), reference.PATH: reference.render()}
    for name, content in generated.items():
        path = root / name
        if not path.exists() or path.read_text(encoding="utf-8") != content:
            changed.append(name)
            if write:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m fedadapt.config --write|--check [--root DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd())
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the tables")
    mode.add_argument("--check", action="store_true", help="fail if they are stale")
    args = parser.parse_args(argv)
    changed = sync_files(args.root, write=args.write)
    if changed and args.check:
        print(f"stale run-config tables in: {', '.join(changed)}; run "
              "`python -m fedadapt.config --write`", file=sys.stderr)  # fmt: skip
        return 1
    for name in changed:
        print(f"updated {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
