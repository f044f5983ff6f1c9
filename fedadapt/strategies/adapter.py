"""The adapter core shared by both Flower APIs: running a rule on a round.

:class:`RuleHost` holds the framework-free rule
(:class:`~fedadapt.strategies.core.ServerRule`) and does for a Flower
adapter (:class:`~fedadapt.strategies.RuleStrategy`,
:class:`~fedadapt.strategies.legacy.LegacyRuleStrategy`) what Flower's
``aggregate_train`` / ``aggregate_fit`` would: screen the replies
(:mod:`fedadapt.strategies.screening`), form the round's statistics and apply
the rule (:func:`apply_rule`, :mod:`fedadapt.strategies.core.aggregation`),
record a report per round, count rounds without a usable reply (and end the
run after too many) and save/restore the rule's state.

A reported ``update-sq-norm`` never steers the step unless the strategy runs
in secure-aggregation mode: the server uses its own ‖Δ_i‖² and counts the
mismatches. Non-finite values are caught on the aggregate (one cheap pass);
only then are the replies scanned one by one to find and drop the culprits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from logging import DEBUG, ERROR, INFO, WARNING
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
from flwr.common.logger import log

from fedadapt._validation import check_choice, check_scalar
from fedadapt.strategies import wire
from fedadapt.strategies.arrays import ReplyError, all_finite
from fedadapt.strategies.core import (
    Arrays,
    RoundStatistics,
    ServerRule,
    Trainable,
    untrained,
)
from fedadapt.strategies.core.aggregation import (
    AGGREGATIONS,
    NORM_BOUND_MODES,
    apply_statistics,
    median_norm,
    round_statistics,
)
from fedadapt.strategies.core.influence import (
    DEFAULT_INFLUENCE_TOLERANCE,
    ValidationLoss,
    influence_limit,
    negative_influence,
)
from fedadapt.strategies.core.robust import (
    DEFAULT_NUM_HOSTILE,
    AggregatorState,
    Defence,
    RobustOptions,
    required_replies,
)
from fedadapt.strategies.screening import (
    NORM_RTOL,
    ScreenReport,
    TrainReply,
    canonical_order,
    screen,
)
from fedadapt.strategies.secagg import secure_aggregation_mode

if TYPE_CHECKING:
    from fedadapt.strategies.local_update import LocalUpdate

#: Default of every strategy's ``aggregation``: the rule's own robust
#: aggregator (:attr:`~fedadapt.strategies.core.base.ServerRule.robust_aggregation`:
#: multi-Krum for FedAdam; centered clipping for FedExP, FedDuAdagrad and
#: Fed-LAMB; the trimmed mean cutting f = ``num_hostile`` values at each end
#: for FedAvgM; the mean for the others) where the round allows it, else the
#: mean (:func:`round_aggregation`). Issue #38: with the mean one hostile
#: client of ten cost the first four rules 2.6-4.8 accuracy points on
#: digits-mlp; with their aggregator at most 1.8, their honest runs within
#: 0.5 (Fed-LAMB: 5.2 -> 2.4; docs/robustness.md).
AUTO_AGGREGATION = "auto"

#: Under ``"auto"``, the most hostile clients (``num_hostile``) for which a
#: rule keeps its own aggregator; told to expect more, it runs
#: :data:`AUTO_COLLUDER_AGGREGATION` with that f (issue #38: the operator
#: who sets f wants f withstood). The mean has no f: two colluders of ten
#: cost FedAvg, FedAdagrad, FedYogi, FedExPM and FedDuAdam 16-62 points on
#: it. Centered clipping bounds each client's push by τ/n and colluders add
#: up: it holds two (FedExP, FedDuAdagrad, Fed-LAMB 4.3-10.0 points), not
#: three (31-70). Multi-Krum keeps f colluders that send the same point
#: (``selected-ipm``: each supports the others' Krum scores): 13-52 points
#: with two, 37-74 with three (stop 69). Measured: docs/robustness.md,
#: "num-hostile for every rule" and "Colluders on one point".
AUTO_MAX_HOSTILE = {"mean": 1, "multi_krum": 1, "centered_clipping": 2}

#: What ``"auto"`` runs for a rule told more colluders than its aggregator
#: holds (:data:`AUTO_MAX_HOSTILE`): the coordinate-wise trimmed mean
#: cutting f values at each end (:func:`auto_trim_fraction`, FedAvgM's own).
#: On digits-mlp its worst attack with two colluders is 4.1-9.5 points for
#: every rule but FedAvg (32.9) and FedYogi (19.0), against multi-Krum's
#: 12.6-52.4; with three 17.7-54.3 against 37-74 (stop 69).
AUTO_COLLUDER_AGGREGATION = "trimmed_mean"

#: What a strategy's ``aggregation`` accepts.
STRATEGY_AGGREGATIONS = (AUTO_AGGREGATION, *AGGREGATIONS)


def round_aggregation(
    aggregation: str,
    rule: ServerRule,
    num_replies: int | None,
    num_hostile: int = DEFAULT_NUM_HOSTILE,
    *,
    mean_required: bool = False,
) -> str:
    """Return the aggregator a round of ``num_replies`` replies runs.

    Any ``aggregation`` but ``"auto"`` as given. ``"auto"``: the rule's
    ``robust_aggregation`` unless the round must be the mean
    (``mean_required``: under secure aggregation, whose sums no aggregator
    of an update's content can judge; with the influence screen or the
    opposing projection, opt-in defences that act on the mean, so that
    turning one on is never a silent no-op) and when the round has at least
    2f + 3 replies (f = ``num_hostile``; Krum's n > 2f + 2, the fewest in
    which f hostile updates are outvoted; None: any number); the mean
    otherwise (our choice: where no single client can be outvoted, as in
    a quickstart of two clients, the rule runs the papers' method). A rule
    told to expect more hostile clients than its aggregator is kept for
    (:data:`AUTO_MAX_HOSTILE`) runs :data:`AUTO_COLLUDER_AGGREGATION` with
    that f instead.
    """
    if aggregation != AUTO_AGGREGATION:
        return aggregation
    if mean_required:
        return "mean"
    if num_replies is not None and num_replies < required_replies("krum", num_hostile):
        return "mean"
    chosen = rule.robust_aggregation
    if num_hostile > AUTO_MAX_HOSTILE.get(chosen, num_hostile):
        return AUTO_COLLUDER_AGGREGATION
    return chosen


def auto_trim_fraction(num_hostile: int, num_replies: int) -> float:
    """Return the trim fraction of ``"auto"``'s trimmed mean.

    FedAvgM's, and every rule's told more colluders than its own aggregator
    holds (:data:`AUTO_COLLUDER_AGGREGATION`).

    (f + ½)/n, so that ``int(fraction · n)`` cuts exactly f =
    ``num_hostile`` values at each end of every coordinate, the fewest
    that keep f hostile values out wherever they are the extremes (our
    choice: a fixed fraction would cut nothing in a round of fewer than
    1/fraction replies). One of ten: 0.15, one cut, as the 0.1 measured
    (docs/robustness.md). Below ½ in every round ``"auto"`` runs it in
    (n ≥ 2f + 3).
    """
    return (num_hostile + 0.5) / max(num_replies, 1)


#: Default of ``max_update_norm_ratio``: an update above 2x the round's
#: median update norm is clipped to 2x that median (``norm_bound_mode``
#: "clip"), so no client weighs more than two typical ones, however it
#: scales its update. Issue #38's attack suite (docs/robustness.md): with
#: the earlier default (flag above 5x, scale to the median of the others)
#: a client at 4.95x the median sign-flipping its update cost FedExP 71
#: accuracy points on digits-mlp; at 2x and with the step guard the worst
#: attack costs at most 2.5 (mean 1.x) while honest runs moved by ≤ 0.5
#: points (1x cost FedDuA 2.4 points honestly). Honest clients measured up
#: to 2.7x the median (docs/failures.md): those are clipped, which the
#: honest runs above include.
DEFAULT_NORM_RATIO = 2.0

#: Default of ``max_weight_ratio``: a client's ``num-examples`` counts at
#: most 2x the round's median count (a claim of 100x the data otherwise
#: takes the whole weight: docs/robustness.md, attack ``false-weight``).
DEFAULT_WEIGHT_RATIO = 2.0

#: Default of ``max_contribution_ratio``: a client's pull on Δ̄ (its weight
#: times its clipped norm) is at most 2x the round's median pull; the norm
#: bound and the weight cap alone let one client pull like 4 typical ones
#: (docs/robustness.md, attack ``false-weight``: FedAvg lost 27 points).
DEFAULT_CONTRIBUTION_RATIO = 2.0

#: Default of ``max_update_norm_growth``: no update counts with a norm above
#: 3x the first round's median update norm. With three colluders of ten the
#: adaptive steps (FedExP(M), FedDuA) diverged: each round's move was only
#: 1.5-5x the clients' RMS norm, but the model it left made every client's
#: next update larger, and the 2x-median bound grew with them (√A ×10⁶ in
#: 20 rounds); honest digits-mlp runs never reach 3x (docs/robustness.md).
DEFAULT_NORM_GROWTH = 3.0

#: Fewest replies a round needs to anchor the norm ceiling: the median of
#: two replies is their mean, which one client sets as it likes (a huge
#: update in that round would lift the ceiling for good).
ANCHOR_MIN_REPLIES = 3

#: The key of the aggregator's state (centered clipping's centre) in
#: :meth:`RuleHost.state_dict`.
AGGREGATOR_STATE = "aggregator"


class ScreeningKwargs(TypedDict, total=False):
    """fedadapt's options, accepted by every strategy (see :class:`RuleHost`)."""

    secure_aggregation: bool | str
    max_update_norm: float
    max_update_norm_ratio: float | None
    norm_bound_mode: str
    max_weight_ratio: float
    max_contribution_ratio: float
    max_update_norm_growth: float
    project_opposing: bool
    step_guard: bool
    aggregation: str
    trim_fraction: float
    num_hostile: int
    krum_keep: int
    clip_radius: float
    clip_iterations: int
    max_failed_rounds: int
    trainable: Trainable | None
    validation_loss: ValidationLoss | None
    influence_tolerance: float


class RuleHost:
    """What both Flower adapters share: the rule, screening, reports and state.

    Parameters
    ----------
    rule : ServerRule
        The framework-free update rule (:mod:`fedadapt.strategies.core`).
    average_last_two : bool (default: False)
        Evaluate (w_t + w_{t+1})/2 instead of w_{t+1}; training continues
        from w_{t+1} (FedExP, arXiv:2301.09604; FedDuA §5.1 does the same).
    secure_aggregation : bool | str (default: False)
        ``"off"`` (False), ``"trust-reported-norms"`` (True) or
        ``"secagg+"`` (:mod:`fedadapt.strategies.secagg`: real SecAgg+,
        legacy API only; the server sees only sums and steps on them; every
        per-client defence below is off, as in the trusting mode, and the
        norm bounds become the clients': they clip to the bound the server
        sends, ``max_update_norm`` and k × the previous round's median
        norm).
        ``"trust-reported-norms"``: nothing is masked; use the clients'
        reported ``update-sq-norm``
        as given (a secure aggregator reveals only sums, so the server cannot
        check them). A rule that needs the norms (FedExP, FedDuA) then
        rejects, with a warning and a count, every train reply without one:
        a secure aggregator could not compute it either, so a silent
        fallback to the server's own norms would run a different mode than
        the one asked for (our choice). Off (default): the server computes
        each ‖Δ_i‖² from the
        arrays while summing them, uses its own value, and logs and counts
        (``norm_mismatches``) every reported value that differs by more than
        :data:`NORM_RTOL` relative. A mismatching reply is kept, not dropped:
        a rounding disagreement must never cost an honest client its reply,
        and with the server's norm a lie no longer changes the step.
    max_update_norm : float (default: 0.0)
        C > 0 clips each client's update to ‖Δ_i‖ ≤ C before it enters Δ̄
        and A (counted as ``clipped``); 0 turns clipping off. Under
        ``"secagg+"`` the clients clip to it (:mod:`fedadapt.strategies.
        secagg`); not with ``"trust-reported-norms"``.
    max_update_norm_ratio : float | None (default: None)
        k > 0: the detection threshold of norm bounding (Sun et al. 2019). A
        client update with ‖Δ_i‖ > k·m, m = median_j ‖Δ_j‖ of the round, is
        scaled down to the median norm of the updates not flagged before it
        enters Δ̄ and A (counted as ``clipped``, k·m recorded as the
        diagnostic ``update-norm-bound``), so a flagged client weighs like
        one typical client, however large its update (our choice: Sun et al.
        bound to a fixed M, and clipping to k·m left a ×1e6 client at
        22–34 % off the honest loss, docs/failures.md;
        :func:`~fedadapt.strategies.core.base.clip_scales`). Updates at or
        below k·m are untouched: a round without an outlier is aggregated
        exactly as without clipping. With ``max_update_norm`` the smaller
        factor applies. None =
        :data:`DEFAULT_NORM_RATIO` (2), or off under
        ``"trust-reported-norms"``; 0 = off. What happens above k·m is
        ``norm_bound_mode``'s. Under ``"secagg+"`` the server knows no
        individual norm: the clients clip to k × the previous round's
        weighted median norm from the norm histogram in the masked sums
        (:func:`~fedadapt.strategies.secagg.median_from_histogram`).
    norm_bound_mode : str (default: "clip")
        ``"clip"``: an update above k·m is clipped to k·m (each client
        weighs at most k typical ones; the default since issue #38, whose
        attack suite showed a client kept just under a detection threshold
        of 5 costing FedExP 71 accuracy points). ``"flag"``: the earlier
        rule described above (scaled to the median of the unflagged
        updates, untouched below k·m).
    max_weight_ratio : float (default: 2.0)
        c > 0 caps each reply's ``num-examples`` at c times the round's
        median count before weighting (a count is the client's claim);
        0 = off. No effect under uniform weighting.
    max_contribution_ratio : float (default: 2.0)
        k > 0 bounds each reply's pull on Δ̄, its weight times its
        (clipped) update norm, to k times the round's median pull
        (:func:`~fedadapt.strategies.core.aggregation.contribution_scales`;
        counted as clipped); 0 = off. Under uniform weighting it adds
        nothing to the norm bound. Needs the individual updates.
    max_update_norm_growth : float (default: 3.0)
        g > 0 clips every update to g times the first round's median update
        norm (its anchor, kept in the checkpointed state), on top of
        ``max_update_norm`` and the round's relative bound: a federation
        whose clients' updates keep growing (a model driven off by
        colluders: every client's next update is larger, and so is the
        round's median) cannot feed that growth back into the server's
        step. 0 = off. Under SecAgg+ (legacy API) it caps the bound the
        clients clip to (its anchor the first round's median from the norm
        histogram); inactive with ``"trust-reported-norms"``.
    project_opposing : bool (default: False)
        Remove from each update its component against the weighted mean of
        the other updates, where it has one
        (:func:`~fedadapt.strategies.core.aggregation.opposing_projection`):
        no client pulls Δ̄ back along what the others agree on (sign flip,
        inner-product manipulation). Each reply's record has its
        ``consensus_cos``. Needs the individual updates, as the step guard.
        Off by default: it moved honest runs of the smoke suites by up to 6
        accuracy points, where clients hold one class each and honest
        updates oppose one another (docs/robustness.md); on Dirichlet-0.5
        digits it cut what a sign flip costs FedAvg from 12.8 to 5.4 points
        and IPM from 11.8 to 1.4, honest runs within 0.3. It harmed
        FedDuAdam and FedExPM there.
    step_guard : bool (default: True)
        FedExP / FedExPM / FedDuA: cap the server step size η_t at the
        smallest step the round would give without any one client
        (leave-one-out, :meth:`FedDuARule.guard_step_size
        <fedadapt.strategies.feddua.FedDuARule.guard_step_size>`), so no
        single client raises the extrapolation. Other rules have no step
        size to guard. Needs the individual updates: inactive under
        ``secure_aggregation`` and with a robust ``aggregation`` other than
        ``"centered_clipping"`` (``"auto"``'s choice for FedExP and
        FedDuAdagrad), whose last iteration is a mean of clipped updates:
        there each client is left out of that mean, same τ and centre.
    aggregation : str (default: "auto")
        ``"auto"``: the rule's robust aggregator (multi-Krum for FedAdam;
        centered clipping for FedExP and FedDuAdagrad; the trimmed mean
        for FedAvgM, cutting ``num_hostile`` values at each end
        (:func:`auto_trim_fraction`) rather than ``trim_fraction``;
        the mean for the others; the trimmed mean cutting ``num_hostile``
        values at each end for every rule told to expect more hostile
        clients than its aggregator holds, ``num_hostile`` ≥ 2 on the mean
        and multi-Krum, ≥ 3 on centered clipping: :data:`AUTO_AGGREGATION`,
        :data:`AUTO_MAX_HOSTILE`, :data:`AUTO_COLLUDER_AGGREGATION`,
        :func:`round_aggregation`)
        in rounds of at least 2·``num_hostile`` + 3 replies, the mean in
        smaller ones, under ``secure_aggregation`` and with
        ``validation_loss`` or ``project_opposing`` (they act on the
        mean). ``"mean"`` (Σω_iΔ_i, the papers), ``"median"`` or
        ``"trimmed_mean"``: the
        coordinate-wise median / trimmed mean of the updates as the Δ̄ the
        rule steps on (Flower's FedMedian / FedTrimmedAvg applied to
        updates, composed with any rule; see
        :func:`~fedadapt.strategies.core.aggregation.round_statistics`).
        ``"krum"``, ``"multi_krum"``, ``"bulyan"`` (Blanchard et al. 2017;
        El Mhamdi et al. 2018; Flower's Krum, MultiKrum and Bulyan applied
        to updates) or ``"centered_clipping"`` (Karimireddy, He and Jaggi
        2021, from the previous round's Δ̄, kept in the strategy's state):
        see :func:`~fedadapt.strategies.core.robust.robust_statistics`; a
        round with too few replies for ``num_hostile`` uses the largest f
        it allows, with a warning. Not with ``secure_aggregation``.
    trim_fraction : float (default: 0.2)
        Fraction cut from each end per coordinate by ``"trimmed_mean"``, in
        [0, 0.5) (Flower's FedTrimmedAvg ``beta``).
    num_hostile : int (default: 1)
        f, the hostile updates ``"krum"``, ``"multi_krum"`` and
        ``"bulyan"`` assume (Flower's ``num_malicious_clients``); Krum
        needs n ≥ 2f + 3 replies, Bulyan n ≥ 4f + 3. Under ``"auto"`` also
        which aggregator runs (:data:`AUTO_MAX_HOSTILE`).
    krum_keep : int (default: 0)
        m, the updates ``"multi_krum"`` averages; 0 = n − f (Flower's
        ``num_clients_to_keep`` / ``num_nodes_to_select``).
    clip_radius : float (default: 0.0)
        τ of ``"centered_clipping"``; 0 = adaptive, the median over the
        clients of ‖Δ_i − v‖ in each iteration (our choice).
    clip_iterations : int (default: 1)
        L, the iterations of ``"centered_clipping"`` per round.
    validation_loss : Callable[[Mapping[str, NDArray]], float] | None (default: None)
        The server's loss of a model, given as its arrays (keyed as the
        strategy keys the global model: legacy strategies by ``array_names``
        or position), on validation data the server holds. Given, it
        turns on the influence screen (RONI, "reject on negative
        influence", :mod:`~fedadapt.strategies.core.influence`): a reply
        whose presence in the round's mean update raises that loss by more
        than ``influence_tolerance`` (0.5 %) is rejected, the most harmful
        first, and the others are measured again without it (logged,
        counted, at most ⌊(n − 1)/2⌋ per round; each reply's record has its
        ``influence``). The only defence here that judges
        what an update does rather than its size: a client that reverses
        its own update at its own norm and weight cost FedAvg 8 points on
        non-IID digits under every bound (docs/robustness.md has what
        remains with the screen, and what it costs honest runs). It costs one
        validation pass per reply and round, and as many again after each
        rejection. Needs the individual updates
        and the mean (``ValueError`` with ``secure_aggregation`` or a
        robust ``aggregation``). The fedadapt app builds it from run-config
        ``validation-size`` (a sample of the task's training pool) or
        ``validation-data-path``.
    influence_tolerance : float (default: 0.005)
        How much (relative) a reply may raise the validation loss of the
        round's aggregate before the screen rejects it.
    max_failed_rounds : int (default: 3)
        After this many consecutive rounds in which every reply failed or
        was rejected, :class:`FederationFailedError` (with the clients' error
        texts) ends the run; 0 never stops.
    trainable : Collection[str] | Callable[[str], bool] | None (default: None)
        Which arrays are trained: their names (e.g. ``[n for n, _ in
        model.named_parameters()]``) or a predicate ``name -> bool``. The
        others are averaged and kept out of Δ̄'s adaptive part, the
        preconditioner and the norms (the server's ‖Δ_i‖², so a client's
        ``update-sq-norm`` must cover exactly the trained arrays). None: the
        rule's default (FedExP/FedDuA: all float arrays but BatchNorm
        buffers; the others: all float arrays). Non-float arrays are never
        trained. Names that the global model lacks raise ``ValueError`` when
        the first round is configured.

    Attributes
    ----------
    rule : ServerRule
        As given.
    round_reports : dict[int, dict]
        Per round: ``train_replies`` / ``evaluate_replies`` counts and
        rejection reasons, aggregated ``train`` / ``federated_eval`` metrics
        and the rule's ``diagnostics`` (server step size, norms); ``clients``:
        one record per train reply (:func:`~fedadapt.strategies.screening.
        reply_record`, with ``round``), which the app writes to clients.jsonl.
    """

    #: the server half of the algorithm's client-side part (None: plain
    #: clients); set by the adapters' ``local_update`` argument
    local_update: LocalUpdate | None = None
    #: whether the adapter can run under SecAgg+ (the legacy one)
    supports_secagg = False

    def __init__(
        self,
        rule: ServerRule,
        *args: Any,
        average_last_two: bool = False,
        secure_aggregation: bool | str = False,
        max_update_norm: float = 0.0,
        max_update_norm_ratio: float | None = None,
        norm_bound_mode: str = "clip",
        max_weight_ratio: float = DEFAULT_WEIGHT_RATIO,
        max_contribution_ratio: float = DEFAULT_CONTRIBUTION_RATIO,
        max_update_norm_growth: float = DEFAULT_NORM_GROWTH,
        project_opposing: bool = False,
        step_guard: bool = True,
        aggregation: str = AUTO_AGGREGATION,
        trim_fraction: float = 0.2,
        num_hostile: int = DEFAULT_NUM_HOSTILE,
        krum_keep: int = 0,
        clip_radius: float = 0.0,
        clip_iterations: int = 1,
        max_failed_rounds: int = 3,
        trainable: Trainable | None = None,
        validation_loss: ValidationLoss | None = None,
        influence_tolerance: float = DEFAULT_INFLUENCE_TOLERANCE,
        **kwargs: Any,
    ) -> None:
        if not isinstance(rule, ServerRule):
            raise TypeError(f"rule must be a ServerRule, got {type(rule).__name__}")
        if trainable is not None:
            rule.plain_average = untrained(trainable)
        self.trainable = trainable
        self.max_update_norm = check_scalar("max_update_norm", max_update_norm, low=0)
        if check_scalar("max_failed_rounds", max_failed_rounds, low=0) % 1:
            raise ValueError(f"Invalid max_failed_rounds: {max_failed_rounds} (an int)")
        self.max_failed_rounds = int(max_failed_rounds)
        mode = secure_aggregation_mode(secure_aggregation)
        if mode == "trust-reported-norms" and self.max_update_norm > 0:
            raise ValueError(
                "max_update_norm needs the server's own norms, or SecAgg+ "
                "(secure_aggregation='secagg+': the clients clip to it)"
            )
        if mode == "secagg+" and not self.supports_secagg:
            raise ValueError(
                "secure_aggregation='secagg+' exists only for Flower's legacy API "
                "(SecAggPlusWorkflow): use fedadapt.strategies.legacy"
            )
        #: "off", "trust-reported-norms" or "secagg+"
        self.secure_aggregation_mode = mode
        #: whether the server may see only sums (every per-client defence off)
        self.secure_aggregation = mode != "off"
        self.max_update_norm_ratio = self._norm_ratio(max_update_norm_ratio)
        self.norm_bound_mode = check_choice(
            "norm_bound_mode", norm_bound_mode, NORM_BOUND_MODES
        )
        self.max_weight_ratio = check_scalar(
            "max_weight_ratio", max_weight_ratio, low=0
        )
        self.max_contribution_ratio = check_scalar(
            "max_contribution_ratio", max_contribution_ratio, low=0
        )
        self.max_update_norm_growth = check_scalar(
            "max_update_norm_growth", max_update_norm_growth, low=0
        )
        self.project_opposing = bool(project_opposing)
        self.step_guard = bool(step_guard)
        self.aggregation = check_choice(
            "aggregation", aggregation, STRATEGY_AGGREGATIONS
        )
        self.trim_fraction = check_scalar(
            "trim_fraction", trim_fraction, low=0, high=0.5, high_inclusive=False
        )
        explicit = self.aggregation not in ("mean", AUTO_AGGREGATION)
        if self.secure_aggregation and explicit:
            raise ValueError(
                f"aggregation={aggregation!r} needs the individual updates; "
                "under secure_aggregation only their sum is known: use 'mean'"
            )
        if validation_loss is not None and not callable(validation_loss):
            raise TypeError(
                "validation_loss must be a function of a model's arrays, got "
                f"{type(validation_loss).__name__}"
            )
        if validation_loss is not None and (self.secure_aggregation or explicit):
            raise ValueError(
                "validation_loss (the influence screen) needs the individual "
                "updates and their mean: not with secure_aggregation or "
                f"aggregation={aggregation!r}"
            )
        self.validation_loss = validation_loss
        self.influence_tolerance = check_scalar(
            "influence_tolerance", influence_tolerance, low=0
        )
        self.robust_options = RobustOptions(
            num_hostile, krum_keep, clip_radius, clip_iterations
        )
        chosen = round_aggregation(
            self.aggregation,
            rule,
            None,
            self.robust_options.num_hostile,
            mean_required=self.secure_aggregation
            or validation_loss is not None
            or self.project_opposing,
        )
        if self.aggregation == AUTO_AGGREGATION and chosen != "mean":
            log(
                INFO,
                "%s: aggregation 'auto' is %s in rounds of %d replies or more "
                "and the mean in smaller ones (aggregation='mean': the paper's "
                "mean; docs/robustness.md)",
                type(rule).__name__,
                chosen
                if chosen != "trimmed_mean"
                else f"{chosen} (cutting {self.robust_options.num_hostile} "
                "value(s) at each end)",
                required_replies("krum", self.robust_options.num_hostile),
            )
        #: centered clipping's centre (the previous round's Δ̄), checkpointed
        self.aggregator_state = AggregatorState()
        super().__init__(*args, **kwargs)
        self.rule = rule
        self.average_last_two = bool(average_last_two)
        self.round_reports: dict[int, dict[str, Any]] = {}
        # problems of consecutive rounds without a usable reply
        self._failed_streak: list[list[str]] = []
        self._rounds_screened = 0
        #: N, the nodes the current round sampled from (set by the adapters'
        #: configure step; None before): the rule's ``stats.num_nodes``
        self.num_nodes: int | None = None

    def check_trainable(self, model: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` when ``trainable`` names arrays ``model`` lacks."""
        if self.trainable is None or callable(self.trainable):
            return
        missing = sorted(set(self.trainable) - set(model))
        if missing:
            shown = ", ".join(map(repr, list(model)[:8]))
            raise ValueError(
                f"trainable names arrays the global model does not have: "
                f"{', '.join(map(repr, missing))} (its arrays: {shown}"
                f"{', …' if len(model) > 8 else ''}); legacy strategies key "
                "arrays by position unless given array_names"
            )

    def _norm_ratio(self, ratio: float | None) -> float:
        """Return k of ``max_update_norm_ratio`` (None: the default, see above).

        Under SecAgg+ the bound is the clients' (k × the previous round's
        median norm, :mod:`fedadapt.strategies.secagg`); with trusted reports
        there is none.
        """
        trusting = self.secure_aggregation_mode == "trust-reported-norms"
        if ratio is None:
            return 0.0 if trusting else DEFAULT_NORM_RATIO
        ratio = check_scalar("max_update_norm_ratio", ratio, low=0)
        if trusting and ratio > 0:
            raise ValueError(
                "max_update_norm_ratio needs the server's own norms, or SecAgg+ "
                "(whose clients clip); with secure_aggregation="
                "'trust-reported-norms' leave it at None or 0"
            )
        return ratio

    def run_rule(
        self,
        server_round: int,
        candidates: Sequence[TrainReply | str],
        reference: Arrays | None,
        weight_key: str,
    ) -> tuple[Arrays | None, list[TrainReply]]:
        """Screen train replies, apply the rule, record the round's report.

        Returns the new arrays and the replies used, or ``(None, [])`` when
        no reply is usable (or ``reference`` is None): the model is kept.
        Raises :class:`FederationFailedError` after ``max_failed_rounds``
        such rounds in a row.
        """
        label = f"Round {server_round}"
        entry = self.round_reports.setdefault(server_round, {})
        valid, report = screen(
            candidates,
            reference,
            weight_key,
            label,
            weight_optional=self.rule.weighting == "uniform",
            norm_required=self.secure_aggregation and self.rule.needs_sq_norms,
        )
        new: Arrays | None = None
        diagnostics: dict[str, Any] = {}
        if valid and reference is not None:
            new, diagnostics, valid = apply_rule(
                self.rule,
                reference,
                valid,
                weight_key,
                report,
                label,
                secure_aggregation=self.secure_aggregation,
                max_norm=self.max_update_norm,
                max_norm_ratio=self.max_update_norm_ratio,
                aggregation=self.aggregation,
                trim_fraction=self.trim_fraction,
                clip_mode=self.norm_bound_mode,
                max_weight_ratio=self.max_weight_ratio,
                max_contribution_ratio=self.max_contribution_ratio,
                max_norm_growth=self.max_update_norm_growth,
                project_opposing=self.project_opposing,
                step_guard=self.step_guard,
                robust_options=self.robust_options,
                aggregator_state=self.aggregator_state,
                num_nodes=self.num_nodes,
                validation_loss=self.validation_loss,
                influence_tolerance=self.influence_tolerance,
            )
        entry["train_replies"] = report.as_dict()
        # per reply, from the same screening and statistics (clients.jsonl)
        entry["clients"] = [{"round": server_round, **r} for r in report.replies]
        self._count_failed_round(label, report, failed=report.used == 0)
        if new is None:
            return None, []
        entry["diagnostics"] = diagnostics
        return new, valid

    def run_sums(
        self,
        server_round: int,
        candidates: Sequence[TrainReply | str],
        reference: Arrays | None,
        stats: RoundStatistics | None,
        problem: str | None,
        step: bool = True,
    ) -> tuple[Arrays | None, dict[str, Any]]:
        """Apply the rule to a secure aggregator's sums; record the round.

        ``candidates`` are the clients in the sum (their clear metrics
        only) and the failed ones; ``stats`` the sums Δ̄ and A
        (:func:`~fedadapt.strategies.secagg.decode_sums`), or None with the
        ``problem`` that rejects the whole aggregate: no client can be
        singled out, so every one is counted rejected. The same reports and
        failed-round count as :meth:`run_rule`. Returns the new arrays (None:
        the model is kept) and the rule's diagnostics. ``step`` False (a
        SecAgg+ calibration round): the sums are checked and recorded, the
        model and the rule's state stay as they are (the reference arrays
        are returned) and the round does not count as failed.
        """
        label = f"Round {server_round}"
        entry = self.round_reports.setdefault(server_round, {})
        report = ScreenReport()
        if not self._rounds_screened:
            log(
                WARNING,
                "%s: %s: the server sees only the sums Δ̄ and A, so per-client "
                "screening, the server's norm bounds, the weight cap, the step "
                "guard and robust aggregation are off (under secagg+ the "
                "clients clip to the bound the server sends)",
                label,
                self.secure_aggregation_mode,
            )
        for candidate in candidates:
            report.received += 1
            if isinstance(candidate, str):
                report.failed += 1
                report.errors.append(candidate)
                report.note(candidate, "failed")
            elif problem is not None:
                report.count_rejection(candidate, problem, label)
                report.note(candidate, "rejected", problem)
            else:
                report.used += 1
                report.note(candidate, "used")
        new: Arrays | None = None
        diagnostics: dict[str, Any] = {}
        if problem is None and stats is not None and reference is not None:
            if report.used and not step:
                new, diagnostics = dict(reference), {"secagg-calibration": 1.0}
            elif report.used:
                stats = dataclasses.replace(stats, num_nodes=self.num_nodes)
                new, raw = apply_statistics(self.rule, reference, stats)
                diagnostics = {
                    k: (v if math.isfinite(v) else None) for k, v in raw.items()
                }
        elif problem is not None:
            log(ERROR, "%s: secure aggregate rejected: %s", label, problem)
        entry["train_replies"] = report.as_dict()
        if problem is not None:  # why the whole aggregate was refused
            entry["train_replies"]["problem"] = problem
        entry["clients"] = [{"round": server_round, **r} for r in report.replies]
        self._count_failed_round(label, report, failed=new is None)
        if new is not None:
            entry["diagnostics"] = diagnostics
        return new, diagnostics

    def _count_failed_round(
        self, label: str, report: ScreenReport, failed: bool
    ) -> None:
        """Track consecutive rounds without a usable reply; stop after too many."""
        self._rounds_screened += 1
        if not failed:
            self._failed_streak = []
            return
        self._failed_streak.append(report.problems())
        limit = self.max_failed_rounds
        if not limit or len(self._failed_streak) < limit:
            return
        message = self._streak_failure(
            f"{label}: no usable train reply for {limit} consecutive rounds; "
            "stopping the run."
        )
        log(ERROR, "%s", message)
        raise FederationFailedError(message)

    def _streak_failure(self, what: str) -> str:
        """Record and return ``what`` + the failed streak's client errors."""
        problems = sorted({p for round_ in self._failed_streak for p in round_})
        self.failure = f"{what} Client errors and rejections: " + (
            "; ".join(problems) or "none (no replies arrived)"
        )
        return self.failure

    def unusable_run_failure(self) -> str | None:
        """Why a run whose every round so far lacked a usable train reply failed.

        None when some round used a reply (or none ran). A run can end so
        without reaching ``max_failed_rounds`` (fewer rounds than that, or
        ``max_failed_rounds=0``); it has not trained and must not count as
        completed (our choice).
        """
        streak = len(self._failed_streak)
        if not self._rounds_screened or streak != self._rounds_screened:
            return None
        return self._streak_failure(
            f"no round of the run used a train reply ({streak} rounds)."
        )

    def state_dict(self) -> dict[str, Any]:
        """Return the strategy's resumable state (the rule's moments).

        With a local update, its server half's state too (``local_update``);
        with centered clipping, its centre (``aggregator``).
        """
        state = {"rule": self.rule.state_dict()}
        if self.local_update is not None:
            state["local_update"] = self.local_update.state_dict()
        aggregator = self.aggregator_state.state_dict()
        if aggregator:
            state[AGGREGATOR_STATE] = aggregator
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (before training starts).

        A checkpoint without a ``local_update`` entry restores the local
        update from the rule's state: older checkpoints kept Fed-LAMB's v̂
        there (older still, beside it), where
        :class:`~fedadapt.strategies.fedlamb.SecondMoments` finds it.
        """
        own_keys = ("rule", "local_update", AGGREGATOR_STATE)
        extra = {k: v for k, v in state.items() if k not in own_keys}
        rule_state = {**state["rule"], **extra}
        self.aggregator_state.load_state_dict(state.get(AGGREGATOR_STATE) or {})
        if self.local_update is not None:
            own = state.get("local_update")
            self.local_update.load_state_dict(rule_state if own is None else own)
        self.rule.load_state_dict(rule_state)


class FederationFailedError(RuntimeError):
    """Every reply failed or was rejected for too many consecutive rounds."""


def _statistics_finite(stats: RoundStatistics) -> bool:
    if stats.mean_sq_norm is not None and not math.isfinite(stats.mean_sq_norm):
        return False
    return all_finite(stats.mean_update)


def apply_rule(
    rule: ServerRule,
    reference: Arrays,
    valid: Sequence[TrainReply],
    weight_key: str,
    report: ScreenReport,
    round_label: str,
    *,
    secure_aggregation: bool | str = False,
    max_norm: float = 0.0,
    max_norm_ratio: float = 0.0,
    aggregation: str = "mean",
    trim_fraction: float = 0.2,
    clip_mode: str = "flag",
    max_weight_ratio: float = 0.0,
    max_contribution_ratio: float = 0.0,
    max_norm_growth: float = 0.0,
    project_opposing: bool = False,
    step_guard: bool = False,
    robust_options: RobustOptions | None = None,
    aggregator_state: AggregatorState | None = None,
    num_nodes: int | None = None,
    validation_loss: ValidationLoss | None = None,
    influence_tolerance: float = DEFAULT_INFLUENCE_TOLERANCE,
) -> tuple[Arrays | None, dict[str, float | None], list[TrainReply]]:
    """Run ``rule`` on screened replies; return new arrays, diagnostics, used.

    Client-reported ``update-sq-norm`` values are used as given only with
    ``secure_aggregation`` (a bool, or a mode of
    :func:`~fedadapt.strategies.secagg.secure_aggregation_mode`: any but
    ``"off"``; and when every reply has one). Otherwise the rule
    computes each ‖Δ_i‖² while summing the arrays and uses its own value;
    reported values off by more than :data:`NORM_RTOL` are logged and counted
    in ``report.norm_mismatches`` (the reply is kept). ``max_norm`` and
    ``max_norm_ratio`` > 0 clip each update, ``aggregation`` and
    ``trim_fraction`` choose how Δ̄ is formed (see
    :func:`~fedadapt.strategies.core.aggregation.round_statistics`;
    ``"auto"`` per round, :func:`round_aggregation`);
    clipped updates are counted in ``report.clipped`` and the bound is the
    diagnostic ``update-norm-bound``. ``robust_options`` are those of
    Krum, multi-Krum, Bulyan and centered clipping; ``aggregator_state``
    holds centered clipping's centre, replaced by this round's Δ̄ (a
    centre whose arrays do not fit ``reference`` is dropped with a
    warning) and the anchor of ``max_norm_growth`` g > 0: from the round
    after the first one with own norms, a non-zero median and at least
    :data:`ANCHOR_MIN_REPLIES` replies, updates are
    clipped to g times that median as well
    (:meth:`~fedadapt.strategies.core.robust.AggregatorState.norm_ceiling`;
    the diagnostic ``update-norm-ceiling``). What they did goes to each
    reply's record
    (:func:`_record_defence`). ``num_nodes`` reaches the rule as
    ``stats.num_nodes`` (the federation's client count).
    Replies whose data turn out inconsistent or non-finite are dropped here
    (counted in ``report``) and the round is aggregated again without them;
    ``(None, {}, [])`` when none remain. With ``validation_loss`` (the
    server's loss of a model's arrays on its own validation data) a reply
    whose presence raises the loss of the round's aggregate by more than
    ``influence_tolerance`` (relative) is rejected the same way, one at a
    time
    (:mod:`~fedadapt.strategies.core.influence`, :func:`_screen_influence`).
    """
    ordered = canonical_order(list(valid), weight_key)
    # the string "off" is truthy: the mode decides, not the value's truth
    trusts_reports = secure_aggregation_mode(secure_aggregation) != "off"
    options = robust_options or RobustOptions()
    mean_required = trusts_reports or validation_loss is not None or project_opposing
    choose = partial(
        round_aggregation,
        aggregation,
        rule,
        num_hostile=options.num_hostile,
        mean_required=mean_required,
    )
    asked = (
        aggregation == AUTO_AGGREGATION and options.num_hostile > DEFAULT_NUM_HOSTILE
    )
    if asked and not mean_required and choose(len(ordered)) == "mean":
        # told to withstand f colluders, in a round too small to outvote
        # them: say so (the run config refuses such a fixed round size)
        log(
            WARNING,
            "%s: aggregation=auto runs the mean: %d replies, fewer than the %d "
            "in which num_hostile=%d hostile ones are outvoted",
            round_label,
            len(ordered),
            required_replies("krum", options.num_hostile),
            options.num_hostile,
        )
    # centered clipping's centre follows Δ̄ in every round, also in those
    # too small for "auto" to clip in
    centered = choose(None) == "centered_clipping" and aggregator_state is not None
    center = None
    if centered:
        assert aggregator_state is not None
        center = _fitting_center(aggregator_state.center, reference, round_label)
    ceiling = None
    if not trusts_reports and aggregator_state is not None:
        ceiling = aggregator_state.norm_ceiling(max_norm_growth)
        max_norm = ceiled_max_norm(max_norm, ceiling)

    def aggregate(
        replies: Sequence[TrainReply], trusted: list[float] | None, guard: bool
    ) -> RoundStatistics:
        chosen = choose(len(replies))
        return round_statistics(
            rule,
            reference,
            [c.arrays for c in replies],
            [float(c.metrics[weight_key]) for c in replies],
            trusted,
            max_norm=max_norm,
            max_norm_ratio=max_norm_ratio,
            aggregation=chosen,
            trim_fraction=auto_trim_fraction(options.num_hostile, len(replies))
            if aggregation == AUTO_AGGREGATION and chosen == "trimmed_mean"
            else trim_fraction,
            clip_mode=clip_mode,
            max_weight_ratio=max_weight_ratio,
            step_guard=guard,
            robust_options=robust_options,
            center=center,
            max_contribution_ratio=max_contribution_ratio,
            project_opposing=project_opposing,
            own_norms=max_norm_growth > 0,
        )

    # the influence screen's rejections left: set at its first pass
    influence_budget: int | None = None if validation_loss is not None else 0
    while ordered:
        norms = [c.metrics.get(wire.UPDATE_SQ_NORM) for c in ordered]
        reported = [float(n) for n in norms if n is not None]
        trusted = None
        if trusts_reports and len(reported) == len(norms):
            trusted = reported
        try:
            stats = aggregate(ordered, trusted, step_guard)
        except ReplyError as error:
            bad = [c for c in ordered if c.arrays is error.arrays]
            reason = error.reason
        else:
            dropped = _left_out_unseen(ordered, stats.defence, choose(len(ordered)))
            if not _statistics_finite(stats):
                bad = [c for c in ordered if not all_finite(c.arrays)]
                reason = "arrays contain NaN or Inf"
                if not bad:  # finite inputs whose sums overflow: none to single out
                    bad = list(ordered)
                    reason = "aggregate overflowed (values too large)"
            elif any(not all_finite(c.arrays) for c in dropped):
                # an aggregator left a broken reply out of finite statistics
                # (a selection dropped it, a median or trimmed mean cut its
                # values): it is rejected and counted as the mean's path
                # does, not merely left out
                bad = [c for c in dropped if not all_finite(c.arrays)]
                reason = "arrays contain NaN or Inf"
            elif influence_budget is None or influence_budget > 0:
                assert validation_loss is not None
                if influence_budget is None:  # of the replies that are sound
                    influence_budget = influence_limit(len(ordered))
                # the most harmful one only, then measure again without it
                bad = []
                if influence_budget > 0:
                    bad = _screen_influence(
                        ordered,
                        stats,
                        partial(aggregate, list(ordered), trusted, True),
                        reference,
                        validation_loss,
                        influence_tolerance,
                        report,
                        round_label,
                    )
                reason = "negative influence on the server's validation loss"
                if not bad:
                    break
                influence_budget -= 1
            else:
                break
        for candidate in bad:
            report.reject_late(candidate, reason, round_label)
        ordered = [c for c in ordered if all(c is not b for b in bad)]
    else:
        report.warn_none_usable(round_label)
        return None, {}, []
    if stats.client_sq_norms is not None:
        _check_reported_norms(ordered, stats.client_sq_norms, report, round_label)
        if stats.clip_scales is not None:
            ceiling_bound = ceiling is not None and stats.norm_bound == ceiling
            _count_clipped(
                ordered,
                stats.client_sq_norms,
                stats.clip_scales,
                stats.pull_scales,
                report,
                round_label,
                "norm-ceiling" if ceiling_bound else "norm-bound",
            )
    rule.leave_one_out_steps = None
    stats = dataclasses.replace(stats, num_nodes=num_nodes)
    new, diagnostics = apply_statistics(rule, reference, stats)
    if stats.norm_bound is not None:
        diagnostics["update-norm-bound"] = stats.norm_bound
    if ceiling is not None:
        diagnostics["update-norm-ceiling"] = ceiling
    anchors = max_norm_growth > 0 and len(ordered) >= ANCHOR_MIN_REPLIES
    if aggregator_state is not None and anchors:
        aggregator_state.anchor_norm(median_norm(stats.client_sq_norms))
    _record_step_guard(
        ordered, rule.leave_one_out_steps, diagnostics, report, stats.a_left_out
    )
    if stats.consensus_cos is not None:
        diagnostics["projected-updates"] = _record_projection(
            ordered, stats.consensus_cos, report, round_label
        )
    if stats.defence is not None:
        diagnostics.update(_record_defence(ordered, stats.defence, report, round_label))
    if stats.trimmed_shares is not None:
        for candidate, share in zip(ordered, stats.trimmed_shares, strict=True):
            report.record_of(candidate)["trimmed_share"] = share
        diagnostics["trimmed-share-max"] = max(stats.trimmed_shares, default=0.0)
    if centered:
        assert aggregator_state is not None
        aggregator_state.center = {k: np.array(v) for k, v in stats.mean_update.items()}
    clean: dict[str, float | None] = {
        k: (v if math.isfinite(v) else None) for k, v in diagnostics.items()
    }
    clean["norms-trusted"] = float(trusted is not None)
    return new, clean, ordered


def _left_out_unseen(
    replies: Sequence[TrainReply], defence: Defence | None, aggregation: str
) -> list[TrainReply]:
    """Return the replies whose NaN or Inf could miss the round's statistics.

    The mean and centered clipping carry any NaN/Inf into Δ̄, where the
    finiteness check finds it for free. Krum, multi-Krum and Bulyan drop
    whole replies: the dropped ones (few). The coordinate-wise median and
    trimmed mean can cut a broken value in any coordinate: every reply (one
    more pass over the round's arrays, for aggregators that already sort
    each coordinate).
    """
    if aggregation in ("median", "trimmed_mean"):
        return list(replies)
    if defence is None or defence.selected is None:
        return []
    return [c for c, kept in zip(replies, defence.selected, strict=True) if not kept]


def ceiled_max_norm(max_norm: float, ceiling: float | None) -> float:
    """Return a round's absolute norm bound (0: none).

    The smaller of ``max_norm`` (0: none) and the ceiling (None: none).
    """
    if ceiling is None:
        return max_norm
    return min(max_norm, ceiling) if max_norm > 0 else ceiling


def _screen_influence(
    ordered: Sequence[TrainReply],
    stats: RoundStatistics,
    leave_one_out_stats: Callable[[], RoundStatistics],
    reference: Arrays,
    validation_loss: ValidationLoss,
    tolerance: float,
    report: ScreenReport,
    round_label: str,
) -> list[TrainReply]:
    """Return the reply the influence screen rejects, if any; record influences.

    The most harmful reply only: the caller measures again without it
    (:mod:`~fedadapt.strategies.core.influence`).

    The screen needs the leave-one-out means of the step guard
    (:func:`~fedadapt.strategies.core.aggregation.leave_one_out`: the
    server's own norms, the mean, three replies or more); ``stats`` has
    them when the guard is on, ``leave_one_out_stats`` forms them
    otherwise. Where they do not exist (robust aggregation, trusted norms,
    fewer than three replies) it does nothing. A validation loss that
    fails skips the round's screen with a warning: the federation goes on
    unscreened rather than stopping. Each reply's record gets
    ``influence`` (None when not screened).
    """
    if stats.without_each is None:
        stats = leave_one_out_stats()
    if stats.without_each is None:
        return []
    try:
        measured = negative_influence(
            reference, stats.mean_update, stats.without_each, validation_loss, tolerance
        )
    except Exception as error:  # the user's loss function: never end the run
        log(
            WARNING,
            "%s: influence screen skipped: the validation loss failed: %s: %s",
            round_label,
            type(error).__name__,
            error,
        )
        return []
    if len(measured.influence) != len(ordered):  # a client held all the weight
        return []
    for candidate, value in zip(ordered, measured.influence, strict=True):
        report.record_of(candidate)["influence"] = (
            value if math.isfinite(value) else None
        )
    return [ordered[i] for i in measured.rejected[:1]]


def _fitting_center(
    center: Arrays | None, reference: Arrays, round_label: str
) -> Arrays | None:
    """Return ``center`` if its arrays match ``reference``'s, else None (warned)."""
    if center is None:
        return None
    fits = set(center) == set(reference) and all(
        np.shape(center[k]) == np.shape(x) for k, x in reference.items()
    )
    if not fits:
        log(
            WARNING,
            "%s: centered clipping's saved centre does not match the model's "
            "arrays; starting from zero",
            round_label,
        )
        return None
    return center


def _record_defence(
    used: Sequence[TrainReply],
    defence: Defence,
    report: ScreenReport,
    round_label: str,
) -> dict[str, float]:
    """Write what a robust aggregator did into each reply's record; log it.

    Krum, multi-Krum and Bulyan: ``selected`` (whether the update entered
    Δ̄); centered clipping: ``center_clip_scale``, the factor
    min(1, τ/‖Δ_i − v‖) of the last iteration. Returns the round's
    diagnostics: ``hostile-assumed`` (the f used) and ``excluded`` (updates
    left out), or ``center-clip-radius`` (τ of the last iteration) and
    ``center-clipped`` (factors below 1).
    """
    if defence.fallback is not None:
        log(WARNING, "%s: %s: %s", round_label, defence.aggregation, defence.fallback)
    if defence.center_scales is not None:
        for candidate, scale in zip(used, defence.center_scales, strict=True):
            report.record_of(candidate)["center_clip_scale"] = scale
        return {
            "center-clip-radius": float(defence.radius or 0.0),
            "center-clipped": float(sum(s < 1 for s in defence.center_scales)),
        }
    selected = defence.selected or ()
    for candidate, kept in zip(used, selected, strict=True):
        report.record_of(candidate)["selected"] = kept
    return {
        "hostile-assumed": float(defence.num_hostile or 0),
        "excluded": float(sum(not kept for kept in selected)),
    }


def _record_step_guard(
    used: Sequence[TrainReply],
    steps: Sequence[float] | None,
    diagnostics: Mapping[str, float],
    report: ScreenReport,
    a_left_out: int | None = None,
) -> None:
    """Write each client's leave-one-out step size to its record.

    ``server_lr_without``: the server step η the round would have taken
    without this client (the step guard's η_t^{(−i)}); the client whose
    absence gives the smallest one set the cap when ``server-lr-unguarded``
    is in the diagnostics (``step_guard`` = true in its record). An
    operator sees a client that raises the step far above what the others
    give on its own. ``a_left_out``: whether the guard's A left this
    client's ‖Δ_i‖² out (:func:`~fedadapt.strategies.core.aggregation.
    guarded_sq_norms`); a client that is left out round after round sends
    the shortest updates, as a client that tries to slow the step would.
    """
    if steps is None or len(steps) != len(used):
        return
    capped = "server-lr-unguarded" in diagnostics
    lowest = min(steps)
    for i, (candidate, step) in enumerate(zip(used, steps, strict=True)):
        record = report.record_of(candidate)
        record["server_lr_without"] = step
        record["step_guard"] = capped and step == lowest
        record["a_left_out"] = None if a_left_out is None else i == a_left_out


def _record_projection(
    used: Sequence[TrainReply],
    cosines: Sequence[float],
    report: ScreenReport,
    round_label: str,
) -> int:
    """Write each reply's ``consensus_cos``; log the projected ones; count them.

    ``consensus_cos``: cos of the client's (clipped) update with the
    weighted mean of the others'; below 0 its opposing part was removed
    (``projected`` = true). An operator sees a client that keeps pulling
    against the others round after round.
    """
    projected = 0
    for candidate, cos in zip(used, cosines, strict=True):
        record = report.record_of(candidate)
        record["consensus_cos"] = cos
        record["projected"] = cos < 0
        if cos < 0:
            projected += 1
            log(
                DEBUG,
                "%s: removed the part of node %s's update against the others' "
                "mean (cos %.3f)",
                round_label,
                candidate.node,
                cos,
            )
    return projected


def _count_clipped(
    used: Sequence[TrainReply],
    sq_norms: Sequence[float],
    scales: Sequence[float],
    pull_scales: Sequence[float] | None,
    report: ScreenReport,
    round_label: str,
    norm_name: str = "norm-bound",
) -> None:
    """Count and log each clipped update: its node, both norms and which bound.

    ``clipped_by`` in its record is ``norm_name`` (``"norm-bound"``, or
    ``"norm-ceiling"`` when the round's norm bound was the norm ceiling),
    ``"pull-cap"`` (its weight times its norm was above the cap,
    :func:`~fedadapt.strategies.core.aggregation.contribution_scales`), both
    joined by ``+``, or None when not clipped.
    """
    pulls = [1.0] * len(scales) if pull_scales is None else pull_scales
    for candidate, sq, scale, pull in zip(used, sq_norms, scales, pulls, strict=True):
        record = report.record_of(candidate)
        record["clip_scale"] = scale
        if scale < 1:
            by_norm = pull > 0 and scale / pull < 1  # the norm bound's own factor
            by = [
                name
                for name, acted in ((norm_name, by_norm), ("pull-cap", pull < 1))
                if acted
            ]
            record["clipped_by"] = "+".join(by) or None
            report.clipped += 1
            log(
                WARNING,
                "%s: clipped the update of node %s from norm %.6g to %.6g (%s)",
                round_label,
                candidate.node,
                math.sqrt(sq),
                scale * math.sqrt(sq),
                " and ".join(by).replace("-", " "),
            )


def _check_reported_norms(
    used: Sequence[TrainReply],
    computed: Sequence[float],
    report: ScreenReport,
    round_label: str,
) -> None:
    """Log and count each reported ‖Δ_i‖² that disagrees with the server's."""
    for candidate, own in zip(used, computed, strict=True):
        claimed = candidate.metrics.get(wire.UPDATE_SQ_NORM)
        record = report.record_of(candidate)
        record["server_sq_norm"] = own
        if claimed is None:
            continue
        record["norm_mismatch"] = not math.isclose(claimed, own, rel_tol=NORM_RTOL)
        if not record["norm_mismatch"]:
            continue
        report.norm_mismatches += 1
        log(
            WARNING,
            "%s: node %s reported %s = %.6g but its arrays give %.6g; "
            "using the server's value",
            round_label,
            candidate.node,
            wire.UPDATE_SQ_NORM,
            claimed,
            own,
        )


def evaluation_average(previous: Arrays, new: Arrays) -> Arrays:
    """Return (w_t + w_{t+1})/2, the model FedExP/FedDuA evaluate.

    FedExP (arXiv:2301.09604) reports the average of the last two
    iterates, whose extrapolated steps oscillate; FedDuA (§5.1) does the
    same "as in FedExP". Non-float arrays are taken from w_{t+1}.
    """
    return {
        k: ((previous[k] + x) / 2).astype(x.dtype) if x.dtype.kind == "f" else x
        for k, x in new.items()
    }
