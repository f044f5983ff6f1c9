"""The attack suite (issue #38): every strategy × defence × attack, one command.

Hostile clients (:mod:`fedadapt.attacks`: sign flip, orthogonal, "a little
is enough", inner-product manipulation, scaled copy, false norm report,
false weight, label flipping), each tuned to the defence in force (it
knows the norm bound and stays just under it), against every server rule
with every defence. The server step is fedadapt's shared aggregation path
(:func:`fedadapt.strategies.screening.screen` then
:func:`fedadapt.strategies.adapter.apply_rule`: what both Flower APIs and
the app call), so a defence measured here is the one users get.

Two levels:

- ``harness``: least squares in NumPy (10 clients, non-IID drift, local
  gradient steps), the strategies' unit-level harness; label flipping
  negates the client's targets. Seconds for the whole grid.
- ``task``: a real task (digits-mlp, mnist5k-cnn) at its default non-IID
  partition, each client training with the ClientApp's own
  :func:`~fedadapt.client.local.train_round`; label flipping trains on
  y → C−1−y. Final central test accuracy.

For each cell: the final metric, the distance of the final model from the
honest run's (same strategy, defence, seed; the hostile clients then train
honestly), ``‖x_T − x_T^honest‖ / ‖x_T^honest − x_0‖``, and its ratio to
FedAvg's distance under the same attack, defence and clients. Results go
to a JSON file (``--out``), a Markdown table on stdout and a plot.

Usage (from the repository root)::

    python benchmarks/attacks.py harness
    python benchmarks/attacks.py task --task digits-mlp --seeds 5 --rounds 20 \\
        --defences default --hostile 1
    python benchmarks/attacks.py report benchmarks/results/attacks-digits-mlp.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._output import OutputBusyError, owned, write_json  # noqa: E402
from fedadapt.attacks import ATTACKS, UNDER_BOUND, RoundView, craft  # noqa: E402
from fedadapt.config import validate_run_config  # noqa: E402
from fedadapt.server.run import server_validation_loss  # noqa: E402
from fedadapt.server.strategy_factory import (  # noqa: E402
    build_rule,
    secagg_settings,
    trust_kwargs,
)
from fedadapt.strategies import wire  # noqa: E402
from fedadapt.strategies.adapter import (  # noqa: E402
    apply_rule,
    ceiled_max_norm,
    evaluation_average,
    round_aggregation,
)
from fedadapt.strategies.core.aggregation import (  # noqa: E402
    apply_statistics,
    norm_bound,
)
from fedadapt.strategies.core.robust import (  # noqa: E402
    SELECTIONS,
    AggregatorState,
    RobustOptions,
)
from fedadapt.strategies.fedlamb import SecondMoments  # noqa: E402
from fedadapt.strategies.screening import (  # noqa: E402
    TrainReply,
    screen,
)
from fedadapt.strategies.secagg import (  # noqa: E402
    SecAggPlusSettings,
    aggregate_problem,
    decode_sums,
    encode_update,
    entry_for,
    hold_to_ranges,
    next_norm_bound,
    next_weight_cap,
    refusing_nodes,
    rotated_indices,
    step_statistics,
    to_secure_scale,
    typical_norm,
)
from fedadapt.tasks import TASKS  # noqa: E402

Arrays = dict[str, np.ndarray]

STRATEGIES = (
    "fedavg", "fedavgm", "fedadam", "fedadagrad", "fedyogi", "fedexp",
    "fedexpm", "feddua", "feddua-adagrad", "fed-lamb",
)  # fmt: skip

#: Defences as overrides of the aggregation options (``apply_rule``'s
#: keywords) the run config gives; ``default`` is what a user gets without
#: setting anything.
DEFENCES: dict[str, dict[str, Any]] = {
    "default": {},
    # the default of stops 58-60: the norm ceiling, every rule on the mean
    "mean": {"aggregation": "mean"},
    "off": {"max_norm_ratio": 0.0, "aggregation": "mean", "max_weight_ratio": 0.0,
            "max_contribution_ratio": 0.0, "project_opposing": False,
            "step_guard": False, "max_norm_growth": 0.0},
    # the default before issue #38: flag above 5x the median, nothing else
    "before-38": {"max_norm_ratio": 5.0, "clip_mode": "flag", "aggregation": "mean",
                  "max_weight_ratio": 0.0, "max_contribution_ratio": 0.0,
                  "project_opposing": False, "step_guard": False,
                  "max_norm_growth": 0.0},
    # the default of stops 43-48: clip 2x, weight cap 2x, step guard
    "clip-wcap-guard": {"max_contribution_ratio": 0.0, "max_norm_growth": 0.0,
                        "aggregation": "mean"},
    # the default of stops 49-57 (with the pull cap, no norm ceiling)
    "pull-cap": {"project_opposing": False, "max_norm_growth": 0.0,
                 "aggregation": "mean"},
    "no-ceiling": {"max_norm_growth": 0.0, "aggregation": "mean"},
    # the default plus the opposing projection (opt-in)
    "pull-cap-projection": {"project_opposing": True, "max_norm_growth": 0.0,
                            "aggregation": "mean"},
    "projection": {"max_contribution_ratio": 0.0, "project_opposing": True,
                   "max_norm_growth": 0.0, "aggregation": "mean"},
    "clip-median": {"max_norm_ratio": 1.0, "clip_mode": "clip", "aggregation": "mean"},
    "clip-median-wcap": {"max_norm_ratio": 1.0, "clip_mode": "clip",
                         "aggregation": "mean", "max_weight_ratio": 1.0},
    "clip-2median-wcap": {"max_norm_ratio": 2.0, "clip_mode": "clip",
                          "aggregation": "mean", "max_weight_ratio": 1.0},
    "clip-median-wcap-guard": {"max_norm_ratio": 1.0, "clip_mode": "clip",
                               "aggregation": "mean", "max_weight_ratio": 1.0,
                               "step_guard": True},
    "flag-5-guard": {"max_norm_ratio": 5.0, "clip_mode": "flag",
                     "aggregation": "mean", "step_guard": True},
    "clip-2median-wcap-guard": {"max_norm_ratio": 2.0, "clip_mode": "clip",
                                "aggregation": "mean", "max_weight_ratio": 2.0,
                                "step_guard": True},
    "wcap-guard": {"max_weight_ratio": 1.0, "step_guard": True,
                   "aggregation": "mean"},
    "clip-median-wcap2-guard": {"max_norm_ratio": 1.0, "clip_mode": "clip",
                                "aggregation": "mean", "max_weight_ratio": 2.0,
                                "step_guard": True},
    # the influence screen (RONI) on top of the default
    "influence": {},
    "influence-0.01": {},  # its first default tolerance
    "median": {"aggregation": "median"},
    "trimmed-mean": {"aggregation": "trimmed_mean"},
    "trimmed-mean-0.1": {"aggregation": "trimmed_mean", "trim_fraction": 0.1},
    "krum": {"aggregation": "krum"},
    "multi-krum": {"aggregation": "multi_krum"},
    "bulyan": {"aggregation": "bulyan"},
    "centered-clipping": {"aggregation": "centered_clipping"},
    # Flower's SecAgg+: the server sees Δ̄ and A only; the clients clip to
    # the bound B_t it sends (run config below, not apply_rule's options)
    "secagg+": {},
    "secagg+-unrotated": {},
    "secagg+-guarded": {},
    "secagg+-C1": {},
    "secagg+-no-ceiling": {"max_norm_growth": 0.0},  # before stop 58
    "secagg+-one-class": {},
    "one-class": {},
    "one-class-cc": {"aggregation": "centered_clipping"},
    # the client's learning rate (stop 66: Fed-LAMB's and Fed-AMS's defaults)
    **{f"lr-{lr:g}": {} for lr in (0.1, 0.03, 0.01, 0.003)},
    **{f"ams-{lr:g}": {} for lr in (0.1, 0.01, 0.003, 0.001, 0.0003, 0.0001)},
    "ams-mean": {"aggregation": "mean"},
    "ams-cc": {"aggregation": "centered_clipping"},
    # the default told how many colluders to expect (multi-Krum's and the
    # trimmed mean's f, the SecAgg+ quarantine's limit)
    "num-hostile-2": {},
    "num-hostile-3": {},
    # centered clipping with three iterations (Karimireddy et al.'s L = 3)
    "centered-clipping-L3": {},
    # each aggregator written out with num-hostile f (stop 68: which holds
    # f colluders; the trimmed mean cuts f values at each end of ten)
    **{f"{name}-f{f}": {} for f in (2, 3)
       for name in ("mean", "multi-krum", "trimmed-mean", "centered-clipping")},
}  # fmt: skip

#: Defences that are run-config settings rather than aggregation options.
DEFENCE_CONFIG: dict[str, dict[str, Any]] = {
    "influence": {"validation-size": 200},
    "influence-0.01": {"validation-size": 200, "influence-tolerance": 0.01},
    "secagg+": {"secure-aggregation": "secagg+"},
    # before the rotated block: a reply bounded only by c per coordinate
    "secagg+-unrotated": {"secure-aggregation": "secagg+",
                          "secagg-coordinate-bound": 0.0},
    "secagg+-guarded": {"secure-aggregation": "secagg+", "secagg-step-guard": True},
    # a fixed cap C near digits-mlp's typical update norm (0.5–0.7) from round 1
    "secagg+-C1": {"secure-aggregation": "secagg+", "max-update-norm": 1.0},
    "secagg+-no-ceiling": {"secure-aggregation": "secagg+"},
    # Fed-LAMB's own non-IID split (its smoke suite's): one class per client
    "secagg+-one-class": {"secure-aggregation": "secagg+", "partition": "shards",
                          "classes-per-client": 1},
    "one-class": {"partition": "shards", "classes-per-client": 1},
    "one-class-cc": {"partition": "shards", "classes-per-client": 1},
    **{f"lr-{lr:g}": {"client-lr": lr} for lr in (0.1, 0.03, 0.01, 0.003)},
    **{f"ams-{lr:g}": {"client-optimizer": "fed-ams", "client-lr": lr}
       for lr in (0.1, 0.01, 0.003, 0.001, 0.0003, 0.0001)},
    "ams-mean": {"client-optimizer": "fed-ams"},
    "ams-cc": {"client-optimizer": "fed-ams"},
    "num-hostile-2": {"num-hostile": 2},
    "num-hostile-3": {"num-hostile": 3},
    "centered-clipping-L3": {"aggregation": "centered-clipping",
                             "clip-iterations": 3},
    **{f"{name}-f{f}": {"num-hostile": f, "aggregation": name,
                        **({"trim-fraction": f / 10}  # of ten clients
                           if name == "trimmed-mean" else {})}
       for f in (2, 3)
       for name in ("mean", "multi-krum", "trimmed-mean", "centered-clipping")},
}  # fmt: skip

NUM_CLIENTS = 10

#: Attacks on the influence screen itself. They are crafted here, not by
#: :func:`fedadapt.attacks.craft`: they run the server's own aggregation
#: and validation loss (see :func:`frame_replies`).
SCREEN_ATTACKS = ("frame",)
#: Controls, not attacks: ``absent`` leaves the "hostile" clients out of
#: every round (a client that never replies). What a strategy's model does
#: when a client is merely missing is the scale against which an attack's
#: distance from the honest run means something: an adaptive server that
#: moves further than FedAvg when one client is absent is sensitive, not
#: attacked.
CONTROLS = ("absent",)
#: Attacks on Fed-LAMB's second-moment channel (its v, not its model):
#: ``moment-inflate`` sends its honest model update and a v whose total is
#: just under the server's cap (``fed-lamb.max-moment-ratio`` c times the
#: round's median total, the hostile totals placed above every honest one),
#: spread evenly over every coordinate, so that it raises v̂ most where the
#: honest v are smallest (v̂ is a running maximum: a raise lasts, and shrinks
#: the LAMB step there for good). Elsewhere an honest client.
MOMENT_ATTACKS = ("moment-inflate",)
#: Under SecAgg+: ``false-clip`` trains and sends honestly but reports a
#: non-zero ``secagg-clipped``, which refuses the whole masked sum: without
#: the quarantine of stop 64, every round, so that the run ends after
#: ``max-failed-rounds``. ``false-local-clip`` (Fed-LAMB under SecAgg+)
#: trains and sends honestly but claims, every round, that it held its v to
#: the server's ranges (``secagg-local-clipped``): until stop 65 the server
#: widened them 4× on any claim, to 4^4 in four rounds, coarsening every
#: client's v (0.6 points); since, the ranges are per coordinate and fixed,
#: and the claim changes nothing. Elsewhere an honest client.
REPORT_ATTACKS = ("false-clip", "false-local-clip")
#: The framing attack's candidates: multiples of one honest update ...
FRAME_SCALES = (0.5, 1.0, 2.0, 4.0, 8.0)
#: ... of each of the honest clients with the largest updates.
FRAME_TARGETS = 3


def strategy_config(name: str, task: str, overrides: Mapping[str, Any]) -> dict:
    """The validated run config of suite strategy ``name`` with a defence."""
    cfg: dict[str, Any] = {"task": task, "strategy": name, **overrides}
    if name == "feddua-adagrad":
        cfg.update({"strategy": "feddua", "feddua.variant": "adagrad"})
    return validate_run_config(cfg)


def apply_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``apply_rule`` that the run config selects."""
    trust = trust_kwargs(cfg)
    return {
        "secure_aggregation": trust["secure_aggregation"],
        "max_norm": trust["max_update_norm"],
        "max_norm_ratio": trust["max_update_norm_ratio"],
        "aggregation": trust["aggregation"],
        "trim_fraction": trust["trim_fraction"],
        "clip_mode": trust["norm_bound_mode"],
        "max_weight_ratio": trust["max_weight_ratio"],
        "max_contribution_ratio": trust["max_contribution_ratio"],
        "max_norm_growth": trust["max_update_norm_growth"],
        "project_opposing": trust["project_opposing"],
        "step_guard": trust["step_guard"],
        # num-hostile, krum-keep, clip-radius, clip-iterations, as RuleHost's
        "robust_options": RobustOptions(
            trust["num_hostile"],
            trust["krum_keep"],
            trust["clip_radius"],
            trust["clip_iterations"],
        ),
        "validation_loss": None,  # run_grid's, with validation-size > 0
        "influence_tolerance": trust["influence_tolerance"],
    }


def norm_cap(options: Mapping[str, Any], honest_sq: Sequence[float], f: int) -> float:
    """The largest ‖Δ‖ the defence leaves untouched, as an attacker computes it.

    The hostile norms are placed above every honest one (they will be),
    which is where they shift the round's median.
    """
    bound = norm_bound(
        list(honest_sq) + [math.inf] * f, options["max_norm"], options["max_norm_ratio"]
    )
    return math.inf if bound is None else float(bound)


def known_bounds(options: Mapping[str, Any], state: AggregatorState) -> dict:
    """``options`` with the round's norm ceiling in ``max_norm``: the
    attacker knows the first round's median as the server does."""
    ceiling = state.norm_ceiling(options.get("max_norm_growth", 0.0))
    return {**options, "max_norm": ceiled_max_norm(options["max_norm"], ceiling)}


def _diff(a: Arrays, b: Mapping[str, np.ndarray]) -> Arrays:
    return {k: (a[k].astype(np.float64) - b[k]) for k in a}


def float_distance(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """‖a − b‖ over the floating-point arrays, in float64."""
    return math.sqrt(
        math.fsum(
            float(np.sum((a[k].astype(np.float64) - b[k]) ** 2))
            for k in a
            if a[k].dtype.kind == "f"
        )
    )


#: The server's local-update exchange of a round: (train config, arrays),
#: e.g. Fed-LAMB's v̂; None for the strategies without one.
Exchange = tuple[Mapping[str, Any], Arrays] | None
#: train(client, x, round, poisoned, exchange) -> (x_i, num_examples,
#: the local-update arrays it sends back: Fed-LAMB's v, else None)
Trainer = Callable[[int, Arrays, int, bool, Exchange], tuple[Arrays, float, Any]]


def second_moments(cfg: Mapping[str, Any]) -> SecondMoments | None:
    """Fed-LAMB's server half of the v̂ exchange, as the strategy runs it."""
    if cfg["strategy"] != "fed-lamb":
        return None
    return SecondMoments.from_run_config(cfg)  # type: ignore[return-value]


def inflated_moments(
    honest: Sequence[Mapping[str, np.ndarray]], ratio: float, colluders: int
) -> dict[str, np.ndarray]:
    """``moment-inflate``'s v: the largest total the cap leaves unscaled, even.

    With ``ratio`` c = 0 (no cap), 1e6 times the largest honest total.
    """
    totals = [
        math.fsum(float(np.sum(a, dtype=np.float64)) for a in v.values())
        for v in honest
    ]
    if ratio > 0:
        total = UNDER_BOUND * ratio * float(np.median(totals + [math.inf] * colluders))
    else:
        total = 1e6 * max(totals)
    size = sum(a.size for a in honest[0].values())
    return {k: np.full(a.shape, total / size, a.dtype) for k, a in honest[0].items()}


def exchange_moments(
    moments: SecondMoments,
    used: Sequence[TrainReply],
    sent_moments: Mapping[int | str, Any],
) -> None:
    """Fold the used replies' v into v̂ as the strategy does (checked first)."""
    kept, weights = [], []
    for reply in used:
        v = sent_moments.get(reply.node)
        if moments.check_reply(v, reply.metrics) is None:
            kept.append(v)
            weights.append(float(reply.metrics["num-examples"]))
    if kept:
        moments.aggregate(kept, weights)


def federate(
    cfg: Mapping[str, Any],
    options: Mapping[str, Any],
    x0: Arrays,
    train: Trainer,
    rounds: int,
    attack: str | None,
    hostile: Sequence[int],
    seed: int,
) -> tuple[Arrays, dict[str, Any]]:
    """Run ``rounds`` rounds; return the model the strategy reports and counts.

    ``options``: ``apply_rule``'s aggregation keywords (the defence).

    Every client trains each round; the ``hostile`` ones send
    :func:`fedadapt.attacks.craft`'s reply for ``attack`` (None: honest).
    """
    rule, adapter = build_rule(cfg)
    weight_key = "num-examples"
    x, previous = x0, x0
    clipped = mismatches = refused = 0
    rejected = {"rejected": 0, "rejected-hostile": 0}  # honest / hostile replies
    state = AggregatorState()  # centered clipping's centre
    secure = cfg["secure-aggregation"] == "secagg+"
    settings = secagg_settings(cfg, rule) if secure else None
    bound = float(cfg["max-update-norm"]) if secure else 0.0  # B_1
    weight_cap = settings.max_weight if settings is not None else 0.0
    uniform = rule.weighting == "uniform"
    calibrating = secure and bound == 0 and cfg["max-update-norm-ratio"] > 0
    moments = second_moments(cfg)
    quarantined: set[int] = set()  # its secagg_quarantined: never sampled again
    signals: dict[str, list[float]] = {}  # defence_signals, hostile / honest
    for server_round in range(1, rounds + 1):
        exchange: Exchange = None
        if moments is not None:
            scalars, v_hat = moments.configure(server_round, x, NUM_CLIENTS)
            exchange = ({wire.LOCAL_UPDATE: moments.name, **scalars}, v_hat)
        trained = [
            train(i, x, server_round, attack == "label-flip" and i in hostile, exchange)
            for i in range(NUM_CLIENTS)
        ]
        updates = [_diff(xi, x) for xi, _, _ in trained]
        examples = [n for _, n, _ in trained]
        sent_moments: dict[int | str, Any] = {
            i: v for i, (_, _, v) in enumerate(trained)
        }
        honest_ids = [i for i in range(NUM_CLIENTS) if i not in hostile or not attack]
        if secure and bound > 0:  # what the honest clients send: clipped to B_t
            updates = [_clip_to(u, bound) for u in updates]
        sent: dict[int, tuple[Arrays, dict[str, float]]] = {
            i: (updates[i], {}) for i in honest_ids
        }
        if attack in CONTROLS:
            pass  # absent: the hostile clients send nothing
        elif attack in MOMENT_ATTACKS and hostile:
            if moments is None:  # no v̂ exchange: an honest client
                sent.update({i: (updates[i], {}) for i in hostile})
            else:
                inflated = inflated_moments(
                    [sent_moments[i] for i in honest_ids],
                    moments.max_moment_ratio,
                    len(hostile),
                )
                for i in hostile:
                    sent[i] = (updates[i], {})
                    sent_moments[i] = inflated
        elif attack in REPORT_ATTACKS and hostile:
            key = {"false-clip": wire.SECAGG_CLIPPED}.get(
                attack, wire.SECAGG_LOCAL_CLIPPED
            )
            claim = {key: 1.0} if secure else {}
            sent.update({i: (updates[i], dict(claim)) for i in hostile})
        elif attack in SCREEN_ATTACKS and hostile:
            server = ServerRound(rule, options, x, examples, state)
            sent.update(frame_replies(server, sent, hostile))
        elif attack and hostile:
            honest_sq = [_sq(updates[i]) for i in honest_ids]
            robust = options["robust_options"]
            in_force = round_aggregation(  # "auto" as the server resolves it
                options["aggregation"],
                rule,
                NUM_CLIENTS,
                robust.num_hostile,
                mean_required=cfg["secure-aggregation"] != "off"
                or options.get("validation_loss") is not None
                or bool(options.get("project_opposing")),
            )
            secure_view = {}
            if settings is not None:
                ratios = [
                    settings.weight_ratio(1 if uniform else min(n, weight_cap))
                    for n in examples
                ]
                secure_view = {
                    "claim_cap": bound**2 if bound > 0 else settings.clipping_range,
                    "weights": [ratios[i] for i in honest_ids]
                    + [ratios[i] for i in hostile],
                    "weight_cap": math.inf if uniform else weight_cap,
                }
            view = RoundView(
                honest=[updates[i] for i in honest_ids],
                own=[updates[i] for i in hostile],
                norm_cap=bound or math.inf
                if secure
                else norm_cap(known_bounds(options, state), honest_sq, len(hostile)),
                honest_examples=[examples[i] for i in honest_ids],
                seed=seed * 1000 + server_round,
                anchoring=options.get("max_norm_growth", 0.0) > 0
                and state.first_median_norm is None,
                selection=in_force if in_force in SELECTIONS else None,
                assumed_hostile=robust.num_hostile,
                krum_keep=robust.krum_keep,
                center=dict(state.center or {})
                if in_force == "centered_clipping"
                else None,
                coordinate_wise=in_force in ("median", "trimmed_mean"),
                **secure_view,
            )
            for i, reply in zip(hostile, craft(attack, view), strict=True):
                sent[i] = (reply.update, reply.claims)
        if settings is not None:
            sent = {i: r for i, r in sent.items() if i not in quarantined}
            local = None
            if moments is not None:
                local = SecureMoments(
                    moments,
                    {i: sent_moments[i] for i in sent},
                    moments.secure_ranges(),
                    inflate=attack in MOMENT_ATTACKS,
                )
            new, (mean_sq, median), counts = secure_round(
                rule,
                settings,
                x,
                sent,
                examples,
                (bound, weight_cap, cfg["max-update-norm-ratio"] > 0),
                set(hostile) if attack else set(),
                server_round,
                settings.step_guard,
                calibrating,
                local,
                (quarantined, cfg["num-hostile"]),
            )
            if not uniform:
                weight_cap = next_weight_cap(
                    counts, settings.max_weight, options["max_weight_ratio"]
                )
            if new is None:
                refused += 1
                continue
            if not calibrating:  # a calibration round only measures
                previous, x = x, new
            calibrating = False
            growth = options.get("max_norm_growth", 0.0)
            if growth > 0:  # as the legacy strategy's _next_norm_bound
                state.anchor_norm(typical_norm(mean_sq, median))
            bound = next_norm_bound(bound, mean_sq, cfg["max-update-norm"],
                                    cfg["max-update-norm-ratio"], median,
                                    state.norm_ceiling(growth))  # fmt: skip
            continue
        # framing wants rejections; an absent client sends nothing to scale
        knows_screen = attack not in (
            SCREEN_ATTACKS + CONTROLS + MOMENT_ATTACKS + REPORT_ATTACKS
        )
        screened = options.get("validation_loss") is not None
        if attack and hostile and knows_screen and screened:
            server = ServerRound(rule, options, x, examples, state)
            scale = influence_scale(server, sent, hostile)
            for i in hostile:
                sent[i] = ({k: v * scale for k, v in sent[i][0].items()}, sent[i][1])
        candidates = replies(x, sent, examples)
        label = f"round {server_round}"
        valid, report = screen(candidates, x, weight_key, label,
                               weight_optional=rule.weighting == "uniform")  # fmt: skip
        new, _, used = apply_rule(rule, x, valid, weight_key, report, label,
                                  aggregator_state=state, **options)  # fmt: skip
        if moments is not None and new is not None:
            exchange_moments(moments, used, sent_moments)
        clipped += report.clipped
        mismatches += report.norm_mismatches
        for reply in report.replies:  # the influence screen's (and NaN) rejections
            if reply.get("status") == "rejected":
                key = "rejected-hostile" if reply["node"] in hostile else "rejected"
                rejected[key] += 1
            side = "hostile" if reply["node"] in hostile else "honest"
            for name, value in defence_signals(reply).items():
                signals.setdefault(f"{name}-{side}", []).append(value)
        if new is not None:
            previous, x = x, new
    reported = evaluation_average(previous, x) if adapter.get("average_last_two") else x
    counts = {"clipped": clipped, "norm-mismatches": mismatches, **rejected}
    # what clients.jsonl would show an operator, averaged over the run
    counts.update({k: float(np.mean(v)) for k, v in sorted(signals.items())})
    if secure:
        counts["refused-rounds"] = refused
    return reported, counts


#: Per-reply records of clients.jsonl that say what an aggregator did to a
#: reply; the suite averages them over a run, hostile and honest apart.
SIGNALS = ("trimmed_share", "center_clip_scale", "selected")


def defence_signals(record: Mapping[str, Any]) -> dict[str, float]:
    """The :data:`SIGNALS` a reply's record holds (``selected`` as 0/1)."""
    return {
        name: float(record[name]) for name in SIGNALS if record.get(name) is not None
    }


def replies(
    x: Arrays, sent: Mapping[int, tuple[Arrays, Mapping[str, float]]], examples: list
) -> list[TrainReply]:
    """The train replies of a round: client i sends x + Δ_i and its claims
    (clients missing from ``sent`` do not reply)."""
    candidates = []
    for i in sorted(sent):
        delta, claims = sent[i]
        arrays = {
            k: (x[k] + delta[k]).astype(x[k].dtype)
            if x[k].dtype.kind == "f"
            else (x[k] + np.rint(delta[k])).astype(x[k].dtype)
            for k in x
        }
        metrics = {"num-examples": examples[i], "update-sq-norm": _sq(delta), **claims}
        candidates.append(TrainReply(i, metrics, arrays=arrays))
    return candidates


def influence_scale(
    server: ServerRound,
    sent: Mapping[int, tuple[Arrays, Mapping[str, float]]],
    hostile: Sequence[int],
    steps: int = 12,
) -> float:
    """How far the hostile clients scale their replies to pass the influence screen.

    The attacker knows the screen, its tolerance and (the strongest case)
    the server's validation set: it sends c·Δ with the largest c in [0, 1]
    (bisection) at which the server's own round
    (:meth:`ServerRound.rehearse`) rejects none of the hostile replies, so
    it pushes as hard as the screen allows.
    """

    def passes(c: float) -> bool:
        scaled = dict(sent)
        for i in hostile:
            scaled[i] = ({k: v * c for k, v in sent[i][0].items()}, sent[i][1])
        return not server.rehearse(scaled) & set(hostile)

    if passes(1.0):
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if passes(middle) else (low, middle)
    return low


@contextmanager
def _quiet_server() -> Iterator[None]:
    """Silence Flower's logger while an attacker rehearses the server's round."""
    logger = logging.getLogger("flwr")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


@dataclasses.dataclass(frozen=True)
class ServerRound:
    """What an attacker that knows the defence exactly knows of a round.

    The server's rule and aggregator state (copied before each rehearsal),
    its ``apply_rule`` options (the validation loss included: the strongest
    case), the global model and the clients' example counts.
    """

    rule: Any
    options: Mapping[str, Any]
    x: Arrays
    examples: list
    state: AggregatorState

    def rehearse(
        self, sent: Mapping[int, tuple[Arrays, Mapping[str, float]]]
    ) -> set[int]:
        """Run the server's round on copies; return the nodes it rejects.

        The same :func:`screen` and :func:`apply_rule` the server runs.
        """
        with _quiet_server():
            valid, report = screen(
                replies(self.x, sent, self.examples), self.x, "num-examples",
                "rehearsal", weight_optional=self.rule.weighting == "uniform",
            )  # fmt: skip
            apply_rule(copy.deepcopy(self.rule), self.x, valid, "num-examples",
                       report, "rehearsal",
                       aggregator_state=copy.deepcopy(self.state),
                       **self.options)  # fmt: skip
        return {r["node"] for r in report.replies if r.get("status") == "rejected"}


def frame_replies(
    server: ServerRound,
    sent: Mapping[int, tuple[Arrays, Mapping[str, float]]],
    hostile: Sequence[int],
) -> dict[int, tuple[Arrays, dict[str, float]]]:
    """Framing: make the influence screen reject honest clients.

    The screen measures each client's influence against the round's
    aggregate *with every reply in it*. Hostile clients that send a
    multiple s·Δ_j of honest client j's update (their norm reports
    consistent) make the aggregate step further along Δ_j, or overshoot;
    the honest clients with shorter steps (or j itself) then seem to hold
    it back and can be rejected. Over rounds the federation loses data the
    attacker picked; the hostile clients do not mind being rejected too.

    The attacker knows the defence exactly: for each candidate (the
    :data:`FRAME_TARGETS` honest clients with the largest updates ×
    :data:`FRAME_SCALES`) it runs the server's own round
    (:meth:`ServerRound.rehearse`) and sends the
    one that gets the most honest replies rejected (ties: the first).
    Honest replies are taken from ``sent``.
    """
    honest = [i for i in range(NUM_CLIENTS) if i not in hostile]
    targets = sorted(honest, key=lambda i: -_sq(sent[i][0]))[:FRAME_TARGETS]
    best, best_count = None, -1
    for j in targets:
        for s in FRAME_SCALES:
            push = {k: v * s for k, v in sent[j][0].items()}
            trial = {**sent, **{i: (push, {}) for i in hostile}}
            rejected = server.rehearse(trial)
            count = len(rejected - set(hostile))
            if count > best_count:
                best, best_count = push, count
    assert best is not None
    return {i: (best, {}) for i in hostile}


def _clip_to(delta: Arrays, bound: float) -> Arrays:
    """An honest SecAgg+ client's update, clipped to the round's bound B_t."""
    size = math.sqrt(_sq(delta))
    if size <= bound:
        return delta
    return {
        k: a * (bound / size) if a.dtype.kind == "f" else a for k, a in delta.items()
    }


#: What a hostile client puts in each coordinate of its v under SecAgg+: more
#: than any range holds, so Flower's mod clips its entry to +c, the top of
#: the range the server sent in the scale it sent (since stop 65: 2·v̂ at
#: each coordinate, and in round 1 the log scale's top, v = 1e3; before,
#: 4·max v̂ of the array, and v = c / r_i in round 1).
SECURE_INFLATED_MOMENT = 1e30


@dataclasses.dataclass
class SecureMoments:
    """Fed-LAMB's v under SecAgg+ in one round, as the legacy strategy runs it.

    ``sent`` maps each replying client to its v; ``ranges`` is the top of
    each array's range in its scale (:meth:`SecondMoments.secure_ranges`,
    :meth:`SecondMoments.secure_scales`: v/v̂, ln v in round 1);
    ``inflate``: the hostile clients send :data:`SECURE_INFLATED_MOMENT`
    in every coordinate, the most their entries can carry (the top of the
    range: 2·v̂ there, or the log scale's top), where the plain mode's total
    cap (``fed-lamb.max-moment-ratio``) cannot run. The other clients
    send their v in the scales, held to the ranges (:func:`~fedadapt.
    strategies.secagg.to_secure_scale`, :func:`~fedadapt.strategies.
    secagg.hold_to_ranges`); ``cut`` collects those that cut a coordinate.
    """

    moments: SecondMoments
    sent: Mapping[int, Mapping[str, np.ndarray]]
    ranges: Mapping[str, float]
    inflate: bool = False
    cut: set[int] = dataclasses.field(default_factory=set)

    def names(self) -> list[str]:
        """The arrays' order in every masked vector (v̂'s, else the first v's)."""
        v_hat = self.moments.v_hat
        if v_hat is not None:
            return list(v_hat)
        return list(next(iter(self.sent.values())))

    def of(
        self, client: int, hostile: bool, config: Mapping[str, Any]
    ) -> dict[str, np.ndarray]:
        """What ``client`` appends to its masked vector, by name."""
        v = self.sent[client]
        if hostile and self.inflate:
            top = SECURE_INFLATED_MOMENT
            return {k: np.full(np.shape(v[k]), top) for k in self.names()}
        own = {k: np.asarray(v[k]) for k in self.names()}
        scaled = to_secure_scale(own, config, self.moments.v_hat)
        held, cut = hold_to_ranges(scaled, config)
        if cut:
            self.cut.add(client)
        return held


def secure_round(
    rule: Any,
    settings: SecAggPlusSettings,
    x: Arrays,
    sent: Mapping[int, tuple[Arrays, Mapping[str, float]]],
    examples: Sequence[float],
    bounds: tuple[float, float, bool],
    hostile: set[int],
    server_round: int,
    step_guard: bool = False,
    calibrating: bool = False,
    local: SecureMoments | None = None,
    quarantine: tuple[set[int], int] = (set(), 0),
) -> tuple[Arrays | None, tuple[float | None, float | None], list[float]]:
    """One SecAgg+ round as the server sees it: (new model or None, (A, median
    norm), counts).

    ``bounds``: the round's norm bound B_t, weight cap and whether the
    clients send their norm histogram (what the legacy strategy sends);
    ``counts``: the weights the clients sent in the clear.

    Every client encodes with the client's own
    :func:`~fedadapt.strategies.secagg.encode_update` (clip to B_t, the
    rotated block under a bound, norm entry, clip flag); a hostile one
    passes its update with the norm it claims (at most B_t², the top of
    the entry's range: no clip) and reports nothing clipped. Flower's mod
    multiplies each vector by r_i and clips every coordinate to ±c, and
    the server receives Σ clip(r_i·v_i)/Σ r_i (exactly: the quantisation
    only adds noise within the error bound the decoder allows for), which
    :func:`~fedadapt.strategies.secagg.decode_sums` checks and splits and
    the rule steps on, as the legacy strategy's ``_aggregate_secure`` does
    (with its checks: a clear count above the cap fails the round; the step
    guard on the sums; sums that fail the checks on A are taken with
    A = ‖Δ̄‖² in a ``calibrating`` round and where the replies are rotated,
    refused elsewhere; a calibrating round steps neither the model nor
    the rule's state: before stop 59 the suite stepped the rule there and
    dropped only the model, so FedExPM's momentum and FedDuA's moments
    carried round 1's sums where the legacy strategy's do not). None when
    the server would refuse the round (the model is kept).

    ``local``: Fed-LAMB's v, appended to each masked vector in the range
    the server sent (:func:`~fedadapt.strategies.secagg.encode_update`), its
    revealed mean folded into v̂ (:meth:`SecondMoments.aggregate_mean`)
    whenever the round is not refused, the calibration round included, as
    the legacy strategy does.

    ``quarantine``: (the clients the legacy strategy no longer samples, f).
    A round refused by the clear metrics of at most f clients (a clip
    count, a weight over the cap) adds them to it, as its
    ``_quarantine``.
    """
    bound, weight_cap, histogram = bounds
    uniform = rule.weighting == "uniform"
    config = settings.fit_config(
        uniform,
        bound,
        rotation_seed=server_round,
        weight_cap=weight_cap,
        histogram=histogram,
    )
    if local is not None and local.ranges:
        config[wire.SECAGG_LOCAL_RANGES] = json.dumps(dict(local.ranges))
        config[wire.SECAGG_LOCAL_SCALES] = json.dumps(local.moments.secure_scales())
    c = settings.clipping_range
    keys = list(x)
    trainable = [x[k].dtype.kind == "f" for k in keys]
    vectors, ratios, counts, overflow = [], [], [], 0
    reports: dict[str, float] = {}  # the clear secagg-clipped of each client
    for i, (delta, claims) in sorted(sent.items()):
        reports[str(i)] = float(claims.get(wire.SECAGG_CLIPPED, 0.0))
        trained = [(x[k] + delta[k]).astype(x[k].dtype) for k in keys]
        sq = _sq(delta)
        count = examples[i]
        if i in hostile:
            sq = float(claims.get("update-sq-norm", sq))
            sq = min(sq, bound**2) if bound > 0 else sq
            count = claims.get("num-examples", count)
        vector, weight, over = encode_update(
            [x[k] for k in keys],
            trained,
            sq,
            int(count),
            config,
            trainable,
            None if local is None else local.of(i, i in hostile, config),
        )
        if i not in hostile:  # an honest client's check refuses the round
            overflow += over
        elif not uniform:  # a hostile one sends the weight it claims
            weight = int(count)
        counts.append(float(weight))
        ratio = settings.weight_ratio(weight)
        ratios.append(ratio)
        vectors.append([np.clip(ratio * np.asarray(v), -c, c) for v in vector])
    clear = dict(zip(reports, counts, strict=True))
    cap = 0.0 if uniform else weight_cap
    problem = aggregate_problem(settings, reports, clear, cap)
    named = refusing_nodes(reports, clear, cap)
    if problem and named and len(named) <= quarantine[1]:
        quarantine[0].update(int(k) for k in named)
    if overflow or problem:
        return None, (None, None), counts
    mean = [sum(v[j] for v in vectors) / sum(ratios) for j in range(len(vectors[0]))]
    adaptive = rule.adaptive_keys(x) if rule.needs_sq_norms else []
    error = settings.error_bound([1.0 if uniform else n for n in examples])
    rotated = rotated_indices(config, trainable)
    decoded, _ = decode_sums(
        x, mean, adaptive, len(sent), error, norm_bound=bound, clipping_range=c,
        rotated=rotated, rotation_seed=server_round,
        coordinate_bound=settings.coordinate_bound, histogram=histogram,
        tolerate_impossible=calibrating or bool(rotated),
        local=None if local is None
        else {k: entry_for(k, local.ranges, 0.0) for k in local.names()},
    )  # fmt: skip
    if decoded is None:
        return None, (None, None), counts
    if local is not None and decoded.local_mean:
        local.moments.aggregate_mean(decoded.local_mean, len(sent))
    a_t = decoded.stats.mean_sq_norm
    stats = step_statistics(
        decoded, needs_sq_norms=rule.needs_sq_norms, adaptive=adaptive,
        weights=ratios, norm_bound=bound if rotated else 0.0,
        coordinate_bound=settings.coordinate_bound, step_guard=step_guard,
    )  # fmt: skip
    if calibrating:  # measured only: neither the model nor the rule's state moves
        return dict(x), (a_t, decoded.median_norm), counts
    stats = dataclasses.replace(stats, num_nodes=NUM_CLIENTS)
    new, _ = apply_statistics(rule, x, stats)
    return new, (a_t, decoded.median_norm), counts


def _sq(delta: Mapping[str, np.ndarray]) -> float:
    return math.fsum(
        float(np.vdot(a, a)) for a in delta.values() if a.dtype.kind == "f"
    )


# --- the unit-level harness: least squares -----------------------------------

DIM = 20
SAMPLES = 40
#: rows of each client's data the server holds under the influence screen
VALIDATION_ROWS = 4
LOCAL_STEPS = 5
CLIENT_LR = 0.05


def harness_problem(seed: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], Trainer]:
    """Ten least-squares clients with drifting optima and sizes; a trainer."""
    rng = np.random.default_rng(seed)
    x_star = rng.normal(size=DIM)
    data = []
    for i in range(NUM_CLIENTS):
        m = rng.normal(size=(SAMPLES + 8 * i, DIM))
        y = m @ (x_star + 0.5 * rng.normal(size=DIM)) + 0.1 * rng.normal(size=len(m))
        data.append((m, y))

    def train(
        i: int, x: Arrays, server_round: int, poisoned: bool, exchange: Exchange
    ) -> tuple[Arrays, float, None]:
        m, y = data[i]
        target = -y if poisoned else y
        w = x["x"].astype(np.float64)
        for _ in range(LOCAL_STEPS):
            w = w - CLIENT_LR * m.T @ (m @ w - target) / len(target)
        return {"x": w.astype(np.float32)}, float(len(y)), None

    return data, train


def harness_loss(data: Sequence[tuple[np.ndarray, np.ndarray]], x: Arrays) -> float:
    w = x["x"].astype(np.float64)
    return float(np.mean([0.5 * np.mean((m @ w - y) ** 2) for m, y in data]))


# --- real tasks: the ClientApp's own training ---------------------------------


def task_setup(
    cfg: Mapping[str, Any],
) -> tuple[Arrays, Trainer, Callable[[Arrays], float]]:
    """The initial model, a trainer and the central accuracy of ``cfg``'s task."""
    import torch
    from flwr.app import RecordDict
    from torch.utils.data import Dataset

    from fedadapt.client import local
    from fedadapt.server.run import central_evaluator, initial_state
    from fedadapt.tasks import TASKS
    from fedadapt.tasks.base import ClientData

    task = TASKS.get(cfg["task"])
    classes = task.data_spec.num_classes if hasattr(task, "data_spec") else 10

    class Flipped(Dataset):
        def __init__(self, base: Dataset) -> None:
            self.base = base

        def __len__(self) -> int:
            return len(self.base)  # type: ignore[arg-type]

        def __getitem__(self, index: int) -> tuple[Any, Any]:
            x, y = self.base[index]
            return x, (classes - 1 - torch.as_tensor(y))

    honest_data = local.partition_data

    def train(
        i: int, x: Arrays, server_round: int, poisoned: bool, exchange: Exchange
    ) -> tuple[Arrays, float, Any]:
        config, local_arrays = exchange if exchange is not None else (None, None)
        if poisoned:
            local.partition_data = lambda c, p, n: (  # type: ignore[assignment]
                lambda d: ClientData(Flipped(d.train), d.test)
            )(honest_data(c, p, n))
        try:
            result = local.train_round(cfg, i, NUM_CLIENTS, x, cfg["client-lr"],
                                       server_round, config, local_arrays,
                                       RecordDict())  # fmt: skip
        finally:
            local.partition_data = honest_data
        state = {k: v.numpy() for k, v in result.state.items()}
        return state, float(result.metrics["num-examples"]), result.local_arrays

    evaluate = central_evaluator(task, cfg)
    assert evaluate is not None
    return initial_state(task, cfg), train, lambda x: evaluate(x)["accuracy"]


# --- the grid ------------------------------------------------------------------


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    """Run every cell; return the suite's JSON document."""
    cells: list[dict[str, Any]] = []
    started = time.perf_counter()
    task = "synthetic-linreg" if args.level == "harness" else args.task
    first = getattr(args, "first_seed", 0)
    for seed in range(first, first + args.seeds):
        for defence in args.defences:
            for name in args.strategies:
                overrides: dict[str, Any] = {
                    "seed": seed,
                    **DEFENCE_CONFIG.get(defence, {}),
                }
                if args.level == "task":
                    overrides["num-server-rounds"] = args.rounds
                cfg = strategy_config(name, task, overrides)
                options = {**apply_options(cfg), **DEFENCES[defence]}
                if args.level == "harness":
                    data, train = harness_problem(seed)
                    x0 = {"x": np.zeros(DIM, dtype=np.float32)}

                    def metric(x: Arrays, data: Any = data) -> float:
                        return harness_loss(data, x)

                    if cfg["validation-size"]:  # the server's rows: a few per client
                        held = [(m[:VALIDATION_ROWS], y[:VALIDATION_ROWS])
                                for m, y in data]  # fmt: skip
                        options["validation_loss"] = partial(harness_loss, held)
                else:
                    x0, train, metric = task_setup(cfg)
                    options["validation_loss"] = server_validation_loss(
                        TASKS.get(task), cfg
                    )
                honest, honest_counts = federate(
                    cfg, options, x0, train, args.rounds, None, (), seed
                )
                honest_metric = metric(honest)
                scale = float_distance(honest, x0) or 1.0
                base = {"seed": seed, "defence": defence, "strategy": name}
                cells.append({**base, "attack": "none", "hostile": 0,
                              "metric": honest_metric, "distance": 0.0,
                              **honest_counts})  # fmt: skip
                for f in args.hostile:
                    hostile = list(range(f))  # clients 0..f-1
                    for attack in args.attacks:
                        model, counts = federate(
                            cfg, options, x0, train, args.rounds, attack, hostile, seed
                        )
                        value = metric(model)
                        cells.append({
                            **base, "attack": attack, "hostile": f, "metric": value,
                            "distance": float_distance(model, honest) / scale,
                            "honest_metric": honest_metric, **counts,
                        })  # fmt: skip
                elapsed = time.perf_counter() - started
                print(f"[{elapsed:7.1f}s] seed {seed} {defence} {name}: "
                      f"honest {honest_metric:.4g}", flush=True)  # fmt: skip
                if getattr(args, "out", None):  # a killed run keeps what it did
                    write_json(
                        args.out, document(args, task, started, cells, "running")
                    )
    return document(args, task, started, cells, "completed")


def document(
    args: argparse.Namespace,
    task: str,
    started: float,
    cells: list[dict[str, Any]],
    status: str,
) -> dict[str, Any]:
    """The suite's JSON document; ``status`` is ``running`` until the grid ends."""
    return {
        "status": status,
        "level": args.level,
        "task": task,
        "metric": "loss" if args.level == "harness" else "accuracy",
        "rounds": args.rounds,
        "clients": NUM_CLIENTS,
        "seconds": time.perf_counter() - started,
        "cells": cells,
    }


def summarise(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Mean over seeds per (defence, strategy, attack, f), with FedAvg's ratio."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for cell in doc["cells"]:
        key = (cell["defence"], cell["strategy"], cell["attack"], cell["hostile"])
        groups.setdefault(key, []).append(cell)
    rows = []
    for (defence, strategy, attack, f), cells in groups.items():
        honest = groups[(defence, strategy, "none", 0)]
        row = {
            "defence": defence, "strategy": strategy, "attack": attack, "hostile": f,
            "metric": float(np.mean([c["metric"] for c in cells])),
            "honest": float(np.mean([c["metric"] for c in honest])),
            "distance": float(np.mean([c["distance"] for c in cells])),
            "worst_cost": max(
                (h["metric"] - c["metric"]) * (1 if doc["metric"] == "accuracy" else -1)
                for c, h in zip(cells, honest, strict=False)
            ),
        }  # fmt: skip
        fedavg = groups.get((defence, "fedavg", attack, f))
        if fedavg and attack != "none":
            d = float(np.mean([c["distance"] for c in fedavg]))
            if d > 0:
                row["distance_vs_fedavg"] = row["distance"] / d
            elif row["distance"] == 0:
                row["distance_vs_fedavg"] = 1.0  # neither moved
            else:
                row["distance_vs_fedavg"] = math.inf
        rows.append(row)
    return rows


def markdown(doc: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """One table per (defence, f): strategies × attacks, cost and distance ratio."""
    accuracy = doc["metric"] == "accuracy"
    out = []
    keys = sorted({(r["defence"], r["hostile"]) for r in rows if r["hostile"]})
    for defence, f in keys:
        chosen = [r for r in rows if r["defence"] == defence and r["hostile"] == f]
        attacks = list(dict.fromkeys(r["attack"] for r in chosen))
        out.append(f"\n{doc['task']}, defence `{defence}`, {f} hostile of "
                   f"{doc['clients']}: " + ("accuracy points lost (mean over seeds) / "
                   if accuracy else "loss change / ") +
                   "distance from the honest run ÷ FedAvg's\n")  # fmt: skip
        out.append("| strategy | honest | " + " | ".join(attacks) + " |")
        out.append("|---" * (len(attacks) + 2) + "|")
        for strategy in dict.fromkeys(r["strategy"] for r in chosen):
            mine = {r["attack"]: r for r in chosen if r["strategy"] == strategy}
            honest = next(iter(mine.values()))["honest"]
            cells = []
            for attack in attacks:
                r = mine.get(attack)
                if r is None:  # a grid where this strategy did not run it
                    cells.append("—")
                    continue
                if accuracy:
                    cost = f"{100 * (r['honest'] - r['metric']):+.1f}"
                else:
                    cost = f"{(r['metric'] - r['honest']) / r['honest']:+.0%}"
                ratio = r.get("distance_vs_fedavg", math.nan)
                cells.append(f"{cost} / {ratio:.2f}×")
            shown = f"{100 * honest:.1f}" if accuracy else f"{honest:.4g}"
            out.append(f"| {strategy} | {shown} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(doc: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Bar chart: distance ÷ FedAvg's per strategy, one panel per attack."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fewest = min((r["hostile"] for r in rows if r["hostile"]), default=0)
    chosen = [r for r in rows if r["hostile"] == fewest and r["attack"] != "none"]
    if not chosen:
        return  # honest runs only: nothing to plot
    attacks = list(dict.fromkeys(r["attack"] for r in chosen))
    defences = list(dict.fromkeys(r["defence"] for r in chosen))
    strategies = list(dict.fromkeys(r["strategy"] for r in chosen))
    fig, axes = plt.subplots(1, len(attacks), figsize=(3 * len(attacks), 4),
                             sharey=True, squeeze=False)  # fmt: skip
    width = 0.8 / max(len(defences), 1)
    for ax, attack in zip(axes[0], attacks, strict=True):
        for j, defence in enumerate(defences):
            values = [
                next((r.get("distance_vs_fedavg", np.nan) for r in chosen
                      if r["attack"] == attack and r["defence"] == defence
                      and r["strategy"] == s), np.nan)
                for s in strategies
            ]  # fmt: skip
            ax.bar(np.arange(len(strategies)) + j * width, values, width, label=defence)
        ax.axhline(1.5, color="red", lw=0.8, ls="--")
        ax.set_title(attack, fontsize=9)
        ax.set_xticks(np.arange(len(strategies)) + 0.4 - width / 2)
        ax.set_xticklabels(strategies, rotation=90, fontsize=7)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("distance from honest run ÷ FedAvg's")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{doc['task']}: {fewest} hostile of {doc['clients']} clients")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _version(path: Path) -> tuple[int, int] | None:
    """Which version of ``path`` is there (atomic writes replace the inode)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def run_grid_to(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run the grid, writing ``out`` as it goes; return the final document.

    A run that ends early marks what it wrote ``stopped`` (a signal) or
    ``failed`` (an error), with why, so the file never says ``running`` for
    a run that is gone. A file this run has not written yet (an earlier
    run's figures) is left as it was.
    """
    before = _version(out)
    try:
        doc = run_grid(args)
    except BaseException as error:
        if _version(out) != before:
            partial = json.loads(out.read_text())
            failed = isinstance(error, Exception)
            partial["status"] = "failed" if failed else "stopped"
            partial["error"] = f"{type(error).__name__}: {error}"
            write_json(out, partial)
        raise
    write_json(out, doc)
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("level", choices=("harness", "task", "report"))
    parser.add_argument("results", nargs="?", help="report: the suite's JSON file")
    parser.add_argument("--task", default="digits-mlp")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds first..first+seeds-1 (to extend an earlier run's seeds)",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--defences", default=",".join(DEFENCES))
    parser.add_argument(
        "--attacks", default=",".join(ATTACKS + MOMENT_ATTACKS + REPORT_ATTACKS)
    )
    parser.add_argument("--hostile", default="1,2,3")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.level == "report":
        doc = json.loads(Path(args.results).read_text())
        out = Path(args.results)
    else:
        args.rounds = args.rounds or (10 if args.level == "harness" else 20)
        args.strategies = args.strategies.split(",")
        args.defences = args.defences.split(",")
        args.attacks = args.attacks.split(",")
        known = ATTACKS + SCREEN_ATTACKS + CONTROLS + MOMENT_ATTACKS + REPORT_ATTACKS
        unknown_attacks = set(args.attacks) - set(known)
        if unknown_attacks:
            parser.error(f"unknown attacks {sorted(unknown_attacks)}; "
                         f"choose from {list(known)}")  # fmt: skip
        args.hostile = [int(f) for f in args.hostile.split(",") if f]  # "": honest only
        unknown = set(args.defences) - set(DEFENCES)
        if unknown:
            parser.error(
                f"unknown defences {sorted(unknown)}; choose from {list(DEFENCES)}"
            )
        name = "harness" if args.level == "harness" else args.task
        out = args.out = args.out or Path("benchmarks/results") / f"attacks-{name}.json"
        # timeout and kill send SIGTERM: end as Ctrl-C does, status said
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            with owned(out):  # a second run with the same --out is refused
                doc = run_grid_to(out, args)
        except OutputBusyError as error:
            parser.error(str(error))
    rows = summarise(doc)
    print(markdown(doc, rows))
    plot(doc, rows, out.with_suffix(".png"))
    print(f"\nresults: {out}, plot: {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
