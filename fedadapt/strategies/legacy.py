"""The same strategies for Flower's legacy API (``NumPyClient`` + ``server_fn``).

:class:`LegacyRuleStrategy` is ``flwr.server.strategy.FedAvg`` (so sampling,
``on_fit_config_fn``, ``evaluate_fn`` and failure handling stay Flower's)
with ``aggregate_fit`` replaced by reply screening + a framework-free rule of
:mod:`fedadapt.strategies.core`: the same code path as the Message API's
:class:`~fedadapt.strategies.RuleStrategy`. The public classes only build
the rule and are generated from the same declarations as the Message-API
classes; their defaults follow Flower's legacy classes (τ = 1e-9 for
FedAdagrad and FedAdam).

Legacy parameters are an ordered list of arrays. Pass ``array_names`` (the
model's ``state_dict`` keys, in order) so that FedExP/FedDuA recognise
BatchNorm buffers by name, average them and keep them out of the norms, as
the Message API does; clients report ``update-sq-norm`` over the parameters,
which is then exactly that set. Without names the arrays are keyed ``"0"``,
``"1"``, … and every float array goes through the rule (the server's own
norms then cover them all). The weight is ``FitRes.num_examples``. The
rule's diagnostics are returned in the fit metrics, prefixed ``strategy-``.

Flower's legacy loop (``Server.fit``) always counts rounds 1 …
``num_rounds`` and cannot be stopped by a strategy. After the stop rule
fired, and before the round after a loaded state
(:meth:`~fedadapt.strategies._control.RunControl.load_state_records`),
the strategy configures no client and evaluates nothing, so those rounds
pass without any work (Flower logs "no clients selected").
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from logging import ERROR, WARNING
from typing import Any, Unpack

from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg as _FlowerFedAvg

from fedadapt.strategies import ALGORITHMS, wire
from fedadapt.strategies._control import (
    CENTRAL,
    FEDERATED,
    TRAIN,
    RunControl,
    StopKwargs,
)
from fedadapt.strategies.adapter import (
    ANCHOR_MIN_REPLIES,
    FederationFailedError,
    RuleHost,
    ScreeningKwargs,
    evaluation_average,
)
from fedadapt.strategies.core import Arrays, ServerRule
from fedadapt.strategies.declaration import Algorithm
from fedadapt.strategies.local_update import (
    LocalUpdate,
    aggregate_replies,
    legacy_names,
    member_kinds,
    round_config,
    screen_replies,
    secure_problem,
)
from fedadapt.strategies.screening import TrainReply, failed_reply
from fedadapt.strategies.secagg import (
    SecAggPlusSettings,
    aggregate_problem,
    decode_sums,
    entry_for,
    next_norm_bound,
    next_weight_cap,
    refusing_nodes,
    reported_count,
    step_statistics,
    typical_norm,
)
from fedadapt.strategies.traffic import RoundTraffic, scalar_bytes

WEIGHT_KEY = wire.NUM_EXAMPLES


class LegacyFedAvgKwargs(ScreeningKwargs, StopKwargs, total=False):
    """Arguments of ``flwr.server.strategy.FedAvg``, passed through unchanged.

    Plus ``array_names`` and ``local_update`` (see
    :class:`LegacyRuleStrategy`) and fedadapt's
    ``secure_aggregation``, ``max_update_norm``, ``max_update_norm_ratio``,
    ``aggregation``, ``trim_fraction``, ``max_failed_rounds`` (see
    :class:`~fedadapt.strategies.adapter.RuleHost`) and ``stop_*``
    (see :class:`~fedadapt.strategies._control.RunControl`).
    """

    array_names: Sequence[str] | None
    local_update: LocalUpdate | None
    secagg: SecAggPlusSettings | None
    secure_aggregation: bool | str
    max_update_norm: float
    max_failed_rounds: int

    fraction_fit: float
    fraction_evaluate: float
    min_fit_clients: int
    min_evaluate_clients: int
    min_available_clients: int
    evaluate_fn: Callable[..., Any] | None
    on_fit_config_fn: Callable[[int], dict[str, Scalar]] | None
    on_evaluate_config_fn: Callable[[int], dict[str, Scalar]] | None
    accept_failures: bool
    initial_parameters: Parameters | None
    fit_metrics_aggregation_fn: Callable[..., dict[str, Scalar]] | None
    evaluate_metrics_aggregation_fn: Callable[..., dict[str, Scalar]] | None


def _failure(failure: tuple[ClientProxy, FitRes] | BaseException) -> str:
    """Return a legacy failure as :func:`failed_reply` (node id when known)."""
    if isinstance(failure, BaseException):
        return failed_reply(None, repr(failure))
    proxy, res = failure
    return failed_reply(proxy.cid, res.status.message or repr(res.status.code))


def _keyed(arrays: NDArrays, names: Sequence[str] | None = None) -> Arrays:
    """Key a parameter list by ``names`` (same length), else by position."""
    if names is not None and len(names) == len(arrays):
        return dict(zip(names, arrays, strict=True))
    return {str(i): a for i, a in enumerate(arrays)}


def _local_arrays(
    metrics: dict[str, Scalar], arrays: NDArrays, model_size: int
) -> tuple[Arrays | None, str | None]:
    """Split a reply's local-update arrays off the end of ``arrays`` (in place).

    Their names are the JSON list under ``local-update-arrays`` in the
    reply's metrics (popped). Returns (arrays by name or None, problem).
    """
    if wire.LOCAL_ARRAYS not in metrics:
        return None, None
    names = legacy_names(metrics.pop(wire.LOCAL_ARRAYS))
    if isinstance(names, str):
        return None, names
    if len(arrays) - model_size < len(names):
        return None, f"{len(names)} local-update arrays named but not sent"
    local = arrays[len(arrays) - len(names) :]
    del arrays[len(arrays) - len(names) :]
    return dict(zip(names, local, strict=True)), None


def _same(parameters: Parameters, other: Parameters | None) -> bool:
    """Whether ``parameters`` are ``other`` (or its copy: a workflow's round trip)."""
    return other is not None and (
        parameters is other or parameters.tensors == other.tensors
    )


def _listed(arrays: Arrays, order: Arrays) -> NDArrays:
    """List ``arrays`` in the key order of ``order``."""
    return [arrays[k] for k in order]


class LegacyRuleStrategy(RuleHost, RunControl, _FlowerFedAvg):
    """Flower's legacy FedAvg with its aggregation replaced by a fedadapt rule.

    Under SecAgg+ (``secagg``) it receives only the clients' weighted mean
    of Δ_i and ‖Δ_i‖² and steps on those sums (:meth:`aggregate_fit`).

    Parameters
    ----------
    rule : ServerRule
        The update rule, e.g. ``FedAdamRule(eta=0.01)``.
    array_names : Sequence[str] | None (default: None)
        Names of the parameter list's arrays (the model's ``state_dict``
        keys); BatchNorm buffers are then recognised by name.
    average_last_two : bool (default: False)
        ``aggregate_fit`` returns (w_t + w_{t+1})/2, the model Flower then
        evaluates and ends with; w_{t+1} is kept and sent to the next
        round's clients.
    secure_aggregation, max_update_norm, max_failed_rounds
        See :class:`~fedadapt.strategies.adapter.RuleHost`.
    max_update_norm_ratio, aggregation, trim_fraction
        See :class:`~fedadapt.strategies.adapter.RuleHost` (hostile clients).
    local_update : LocalUpdate | None (default: None)
        The server half of an algorithm's client-side part (see
        :mod:`fedadapt.strategies.local_update`): its scalars join each
        client's fit config, its arrays follow the model's
        in the parameter list, their names a JSON list under
        ``local-update-arrays`` in the fit config; a client's reply appends
        its local-update arrays the same way (names in its fit metrics).
    secagg : SecAggPlusSettings | None (default: None)
        Run under Flower's SecAgg+ (``SecAggPlusWorkflow``; the app's
        ``secure-aggregation = "secagg+"``): implies
        ``secure_aggregation="secagg+"``. Clients get the settings in their
        fit config and return Δ_i and ‖Δ_i‖² to be masked
        (:mod:`fedadapt.strategies.secagg`); ``aggregate_fit`` receives
        only their weighted mean and steps on it. Not with a
        ``local_update``.
    stop_metric, stop_mode, stop_target, stop_patience, stop_min_delta
        See :class:`~fedadapt.strategies._control.RunControl` (the stop rule);
        the metric is looked up in ``evaluate_fn``'s metrics (``"loss"``
        is its loss), then the aggregated federated evaluation (``"loss"``
        too), then the aggregated fit metrics.
    **kwargs
        Any argument of ``flwr.server.strategy.FedAvg``.
    """

    def __init__(
        self,
        rule: ServerRule,
        *,
        average_last_two: bool = False,
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        names = kwargs.pop("array_names", None)
        local_update = kwargs.pop("local_update", None)
        secagg = kwargs.pop("secagg", None)
        if secagg is not None:
            kwargs["secure_aggregation"] = "secagg+"
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
        if self.secure_aggregation_mode == "secagg+":
            secagg = secagg or SecAggPlusSettings()
            problem = secure_problem(member_kinds(local_update), rule.weighting)
            if problem is not None:
                raise ValueError(
                    f"local_update under secure_aggregation='secagg+': {problem}"
                )
        #: SecAgg+'s settings (None: not under SecAgg+)
        self.secagg: SecAggPlusSettings | None = secagg
        #: B_t, the L2 norm SecAgg+ clients clip to this round (0: none):
        #: ``max_update_norm`` in round 1, then :meth:`_next_norm_bound`
        self.secagg_norm_bound = self.max_update_norm
        #: the weight each client may send (num-examples weighting): Flower's
        #: ``max_weight`` in round 1, then :func:`~fedadapt.strategies.
        #: secagg.next_weight_cap`
        self.secagg_weight_cap = secagg.max_weight if secagg is not None else 0.0
        #: SecAgg+ with a bound wanted (k > 0) but none known yet (no
        #: ``max_update_norm``): the first round only measures (no step)
        self.secagg_calibrating = (
            secagg is not None
            and self.max_update_norm <= 0
            and self.max_update_norm_ratio > 0
        )
        #: the ranges of the local update's arrays sent this round (SecAgg+)
        self._local_ranges: dict[str, float] = {}
        self._local_scales = ""  # the secagg-local-scales this round sent
        #: SecAgg+: nodes left out of every later round because their own
        #: clear metrics refused a round (at most ``num_hostile`` at a time;
        #: see :meth:`_quarantine`); kept in the state records with B_t, the
        #: weight cap and the calibration flag (:meth:`_host_state`)
        self.secagg_quarantined: set[str] = set()
        self.local_update = local_update
        self.array_names = None if names is None else list(names)
        self._sent: Arrays | None = None
        self._last_output: Parameters | None = None
        self._iterate: Arrays | None = None  # w_{t+1} with average_last_two
        self._output: Arrays | None = None  # what _last_output holds
        self._traffic: RoundTraffic | None = None  # the fit instructions' bytes
        self._stopped_after: int | None = None

    supports_secagg = True

    def __repr__(self) -> str:
        """Flower's strategy name line: the rule with its hyperparameters."""
        return f"{type(self).__name__}({self.rule!r})"

    def _idle(self, server_round: int) -> bool:
        """Whether ``server_round`` does nothing (before a resume, after a stop)."""
        if self._resume_round is not None and server_round < self._resume_round:
            return True
        return self._stopped_after is not None and server_round > self._stopped_after

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Sample and configure as Flower does, training from w_{t+1}.

        Decides the stop rule on the previous round first; configures
        nothing when this round is idle (see the module docstring).
        """
        previous = server_round - 1
        if (
            self._stopped_after is None
            and previous > 0
            and not self._idle(previous)
            and self._decide_stop(previous, True)
        ):
            self._stopped_after = previous
        if self._idle(server_round):
            return []
        parameters, model = self._training_model(parameters)
        self._sent = _keyed(model, self.array_names)
        self.check_trainable(self._sent)
        pairs = super().configure_fit(server_round, parameters, client_manager)
        if self.secagg_quarantined:
            pairs = [
                (p, ins) for p, ins in pairs if p.cid not in self.secagg_quarantined
            ]
        extra: NDArrays = []
        # N for both halves: the rule's stats.num_nodes, the local update's
        self.num_nodes = client_manager.num_available()
        if self.local_update is not None and pairs:
            scalars, local = round_config(
                self.local_update, server_round, self._sent, self.num_nodes
            )
            if local:
                scalars[wire.LOCAL_ARRAYS] = json.dumps(list(local))
            extra = list(local.values())
            pairs = [
                (proxy, FitIns(ins.parameters, {**ins.config, **scalars}))
                for proxy, ins in pairs
            ]
        if self.secagg is not None:
            settings: dict[str, Scalar] = dict(self.secagg_fit_config(server_round))
            self._local_ranges = {}
            if self.local_update is not None and self.local_update.masks_arrays():
                self._local_ranges = self.local_update.secure_ranges()
                settings[wire.SECAGG_LOCAL_RANGES] = json.dumps(self._local_ranges)
                self._local_scales = json.dumps(self.local_update.secure_scales())
                settings[wire.SECAGG_LOCAL_SCALES] = self._local_scales
            pairs = [
                (proxy, FitIns(ins.parameters, {**ins.config, **settings}))
                for proxy, ins in pairs
            ]
        if extra:
            packed = ndarrays_to_parameters(model + extra)
            pairs = [(proxy, FitIns(packed, ins.config)) for proxy, ins in pairs]
        self._traffic = RoundTraffic()
        for proxy, ins in pairs:
            self._traffic.add_sent(
                proxy.cid, ins.parameters.tensors, scalar_bytes(ins.config)
            )
        return pairs

    def _training_model(self, parameters: Parameters) -> tuple[Parameters, NDArrays]:
        """Return the model clients train from when the global one is ``parameters``."""
        model: NDArrays | None = None
        if _same(parameters, self._last_output) and self._iterate is not None:
            model = list(self._iterate.values())
        elif self._resume_model is not None:
            given = parameters_to_ndarrays(parameters)
            iterate = self._resumed_iterate(_keyed(given, self.array_names))
            if iterate is None:
                return parameters, given
            model = list(iterate.values())
        if model is None:
            return parameters, parameters_to_ndarrays(parameters)
        return ndarrays_to_parameters(model), model

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Screen results, apply the rule; ``(None, {})`` keeps the model.

        Returns w_{t+1}, or with ``average_last_two`` (w_t + w_{t+1})/2,
        the model Flower evaluates and ends with (w_{t+1} is kept). Under
        SecAgg+ every result carries the same mean [Δ̄…, A]
        (:meth:`_aggregate_secure`).
        """
        self.completed_round = server_round
        if self.secagg is not None:
            return self._aggregate_secure(server_round, results, failures)
        candidates: list[TrainReply | str] = [_failure(f) for f in failures]
        size = len(self._sent or {})
        traffic, self._traffic = self._traffic or RoundTraffic(), None
        for proxy, res in results:
            reply = {**res.metrics, WEIGHT_KEY: res.num_examples}
            traffic.add_received(proxy.cid, res.parameters.tensors, scalar_bytes(reply))
            arrays = parameters_to_ndarrays(res.parameters)
            local, problem = _local_arrays(reply, arrays, size)
            candidates.append(
                TrainReply(
                    proxy.cid,
                    reply,
                    (proxy, res),
                    problem,
                    arrays=_keyed(arrays, self.array_names),
                    local_arrays=local,
                )
            )
        report = self.round_reports.setdefault(server_round, {})
        report["communication"] = traffic.as_dict()
        screen_replies(self.local_update, candidates)
        # Flower's contract: with failures and accept_failures=False, no update
        keep = bool(failures) and not self.accept_failures
        new, valid = self.run_rule(
            server_round, candidates, None if keep else self._sent, WEIGHT_KEY
        )
        if new is None or self._sent is None:
            return None, {}
        diagnostics = self.round_reports[server_round]["diagnostics"]
        diagnostics.update(aggregate_replies(self.local_update, valid, WEIGHT_KEY))
        return self._output_of(server_round, new, diagnostics, valid)

    def _aggregate_secure(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Step on SecAgg+'s mean [Δ̄…, A]; no individual update exists here.

        Rejects the aggregate (the model is kept, the round counts as
        failed) when a client's arrays would have been clipped, when n·Q
        could wrap the masked sum (:func:`~fedadapt.strategies.secagg.
        aggregate_problem`) or when the sums are impossible for honest
        clients (:func:`~fedadapt.strategies.secagg.decode_sums`).
        """
        assert self.secagg is not None
        candidates: list[TrainReply | str] = [_failure(f) for f in failures]
        valid: list[TrainReply] = []
        traffic, self._traffic = self._traffic or RoundTraffic(), None
        for proxy, res in results:
            reply = {**res.metrics, WEIGHT_KEY: res.num_examples}
            traffic.add_received(proxy.cid, [], scalar_bytes(reply))
            valid.append(TrainReply(proxy.cid, reply, (proxy, res)))
        candidates += valid
        report = self.round_reports.setdefault(server_round, {})
        report["communication"] = traffic.as_dict()
        clipped_counts = {
            str(c.node): c.metrics.get(wire.SECAGG_CLIPPED) for c in valid
        }
        uniform = self.rule.weighting == "uniform"
        counts = {str(c.node): float(c.source[1].num_examples) for c in valid}
        cap = 0.0 if uniform else self.secagg_weight_cap
        problem = aggregate_problem(self.secagg, clipped_counts, counts, cap)
        if problem is not None:
            named = refusing_nodes(clipped_counts, counts, cap)
            if self._quarantine(server_round, named, report):
                problem += (
                    f"; node(s) {', '.join(named)} left out of later rounds (a "
                    "client's own claim, not the federation's setting: at most "
                    "num-hostile nodes named)"
                )
        if not uniform and counts:
            self.secagg_weight_cap = next_weight_cap(
                list(counts.values()), self.secagg.max_weight, self.max_weight_ratio
            )
        held = sorted(
            str(c.node)
            for c in valid
            if (reported_count(c.metrics.get(wire.SECAGG_LOCAL_CLIPPED)) or 0) > 0
        )
        if held:  # their v beyond the ranges, held to them (a diagnostic)
            report["secagg_local_held"] = held
        if problem is None and failures and not self.accept_failures:
            problem = "clients failed and accept_failures is False"
        local, local_problem = self._secure_local_names(valid)
        if local and local_problem is None:
            local_problem = self._secure_local_scales(server_round, valid, report)
        problem = problem or local_problem
        rotated, rotated_problem = self._secure_rotated(valid)
        problem = problem or rotated_problem
        stats = None
        decoded = None
        bound = math.inf
        if problem is None and valid and self._sent is not None:
            first = valid[0].source[1].parameters
            if any(not _same(c.source[1].parameters, first) for c in valid):
                problem = "the results carry different arrays: not a SecAgg+ mean"
            else:
                bound = self.secagg.error_bound([r.num_examples for _, r in results])
                adaptive = (
                    self.rule.adaptive_keys(self._sent)
                    if self.rule.needs_sq_norms
                    else []
                )
                decoded, problem = decode_sums(
                    self._sent,
                    parameters_to_ndarrays(first),
                    adaptive,
                    len(valid),
                    bound,
                    norm_bound=self.secagg_norm_bound,
                    clipping_range=self.secagg.clipping_range,
                    local={n: entry_for(n, self._local_ranges, 0.0) for n in local},
                    rotated=rotated,
                    rotation_seed=server_round,
                    coordinate_bound=self.secagg.coordinate_bound,
                    histogram=self.max_update_norm_ratio > 0,
                    # no step, or every reply within κ·B: no extrapolation
                    tolerate_impossible=self.secagg_calibrating or bool(rotated),
                )
                if decoded is not None and decoded.impossible:
                    log(WARNING, "Round %s: %s; taken as A = ‖Δ̄‖² (no "
                        "extrapolation)%s", server_round, decoded.impossible,
                        " in a calibration round, which does not step"
                        if self.secagg_calibrating else "")  # fmt: skip
                if decoded is not None:
                    stats = step_statistics(
                        decoded,
                        needs_sq_norms=self.rule.needs_sq_norms,
                        adaptive=adaptive,
                        weights=[
                            self.secagg.weight_ratio(r.num_examples) for _, r in results
                        ],
                        norm_bound=self.secagg_norm_bound if rotated else 0.0,
                        coordinate_bound=self.secagg.coordinate_bound,
                        step_guard=self.secagg.step_guard,
                    )
        calibrating = self.secagg_calibrating
        new, diagnostics = self.run_sums(
            server_round, candidates, self._sent, stats, problem, step=not calibrating
        )
        if new is None or self._sent is None or decoded is None:
            return None, {}
        self.secagg_calibrating = False
        diagnostics["secagg-error-bound"] = bound
        diagnostics["secagg-norm-bound"] = self.secagg_norm_bound
        diagnostics["secagg-clipped-share"] = decoded.clipped_share
        if decoded.impossible:
            diagnostics["secagg-impossible-sums"] = 1.0
        if self.local_update is not None and decoded.local_mean:
            try:
                diagnostics.update(
                    self.local_update.aggregate_mean(decoded.local_mean, len(valid))
                )
            except ValueError as err:  # its state is kept; the model stepped
                log(ERROR, "Round %s: %s kept its state: %s", server_round,
                    self.local_update.name, err)  # fmt: skip
                diagnostics["local-update-problem"] = str(err)
        if decoded.median_norm is not None:
            diagnostics["secagg-median-norm"] = decoded.median_norm
        a_t = decoded.stats.mean_sq_norm
        self.secagg_norm_bound = self._next_norm_bound(
            a_t, decoded.median_norm, len(valid)
        )
        return self._output_of(server_round, new, diagnostics, valid)

    def secagg_fit_config(self, server_round: int) -> dict[str, float | int]:
        """Return the SecAgg+ entries of round ``server_round``'s fit config.

        The quantisation settings, the norm bound B_t and the rotation's
        seed, the weight cap, and whether the clients append their norm
        histogram (whenever the next bound is k × their median norm).
        """
        assert self.secagg is not None
        return self.secagg.fit_config(
            self.rule.weighting == "uniform",
            self.secagg_norm_bound,
            rotation_seed=server_round,
            weight_cap=self.secagg_weight_cap,
            histogram=self.max_update_norm_ratio > 0,
        )

    def _secure_rotated(
        self, valid: Sequence[TrainReply]
    ) -> tuple[list[int], str | None]:
        """Return the indices of the arrays sent rotated, or why the round fails.

        Under a bound and κ > 0 every client sends its trainable arrays as
        one rotated block (:func:`~fedadapt.strategies.secagg.encode_update`)
        and names them in the clear; all must name the same floating-point
        arrays of the model. A reply that names none, when the server asked
        for the rotation, would have sent its update unbounded: refused.
        """
        assert self.secagg is not None
        if self.secagg_norm_bound <= 0 or self.secagg.coordinate_bound <= 0:
            return [], None
        declared = {str(c.metrics.get(wire.SECAGG_ROTATED)) for c in valid}
        if len(declared) != 1:
            return [], "the replies declare different rotated arrays"
        try:
            rotated = [int(j) for j in json.loads(declared.pop())]
        except (TypeError, ValueError):
            rotated = []
        keys = list(self._sent or {})
        if (
            not rotated
            or sorted(set(rotated)) != rotated
            or any(
                not 0 <= j < len(keys) or (self._sent or {})[keys[j]].dtype.kind != "f"
                for j in rotated
            )
        ):
            return [], (
                f"{wire.SECAGG_ROTATED} must list the indices of floating-point "
                "model arrays (the client sent its update without the rotation "
                "this round asked for)"
            )
        return rotated, None

    def _host_state(self) -> dict[str, Any]:
        """SecAgg+'s server state, for :meth:`state_to_records`.

        B_t, the weight cap, whether the next round calibrates, and the
        quarantined nodes: without them a resumed run would calibrate
        again (a round without a step), accept any weight up to Flower's
        ``max_weight`` for a round, and sample the quarantined nodes again.
        """
        if self.secagg is None:
            return {}
        return {
            "secagg": {
                "norm-bound": float(self.secagg_norm_bound),
                "weight-cap": float(self.secagg_weight_cap),
                "calibrating": bool(self.secagg_calibrating),
                "quarantined": json.dumps(sorted(self.secagg_quarantined)),
            }
        }

    def _load_host_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`_host_state`; a state without it leaves these fresh.

        Raises ValueError for a damaged entry (a bound or cap that is no
        finite number ≥ 0, a quarantine that is no list of node ids).
        """
        saved = state.get("secagg")
        if saved is None or self.secagg is None:
            return
        missing = sorted(
            {"norm-bound", "weight-cap", "calibrating", "quarantined"} - set(saved)
        )
        if missing:
            raise ValueError(f"saved SecAgg+ state lacks {', '.join(missing)}")
        numbers = {key: float(saved[key]) for key in ("norm-bound", "weight-cap")}
        for key, value in numbers.items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"saved SecAgg+ {key} must be ≥ 0, got {value}")
        nodes = json.loads(str(saved["quarantined"]))
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise ValueError(
                f"saved SecAgg+ quarantine is not a list of node ids: {nodes!r}"
            )
        self.secagg_norm_bound = numbers["norm-bound"]
        self.secagg_weight_cap = numbers["weight-cap"]
        self.secagg_calibrating = bool(saved["calibrating"])
        self.secagg_quarantined = set(nodes)

    def _quarantine(
        self, server_round: int, nodes: Sequence[str], report: dict[str, Any]
    ) -> bool:
        """Leave ``nodes`` out of every later round under SecAgg+; say if so.

        Their own clear metrics (a clip count, a missing one, a weight over
        the cap) refused this round's masked sum, which cannot be taken
        apart; a hostile client could do that every round and end the run
        after ``max-failed-rounds`` (issue #38). So a node that does it once
        is not sampled again: each such client costs one round. Only when at
        most ``num_hostile`` nodes are named: more than that is a setting
        the federation shares (``secagg-clipping-range`` too small), and the
        round is refused as before, naming the key to raise. The round's
        report lists them (``secagg_quarantined``, in results.json's round).
        """
        if not nodes or len(nodes) > self.robust_options.num_hostile:
            return False
        self.secagg_quarantined.update(nodes)
        report["secagg_quarantined"] = list(nodes)
        log(WARNING, "Round %s: node(s) %s refused the secure aggregate with "
            "their own clear metrics; left out of later rounds",
            server_round, ", ".join(nodes))  # fmt: skip
        return True

    def _secure_local_scales(
        self, server_round: int, valid: Sequence[TrainReply], report: dict[str, Any]
    ) -> str | None:
        """Return why the round fails when a reply did not echo the v scales.

        Every reply echoes the ``secagg-local-scales`` it was sent; one that
        does not (a client from before the scales sends v unscaled, which
        the masked sum would mix silently into v̂) refuses the round, and
        its node is quarantined as for a missing clip count.
        """
        wrong = sorted(
            str(c.node)
            for c in valid
            if str(c.metrics.get(wire.SECAGG_LOCAL_SCALES, "")) != self._local_scales
        )
        if not wrong:
            return None
        self._quarantine(server_round, wrong, report)
        return (
            f"node(s) {', '.join(wrong)} did not echo {wire.SECAGG_LOCAL_SCALES} "
            "(a client that predates it sends its v unscaled: update it)"
        )

    def _secure_local_names(
        self, valid: Sequence[TrainReply]
    ) -> tuple[list[str], str | None]:
        """Return the local-update arrays' names the replies declare, or why not.

        Under SecAgg+ a summable local update's arrays follow the update in
        the masked vector; their names travel in the clear (names only) and
        must be the same in every reply.
        """
        if self.local_update is None or not self.local_update.masks_arrays():
            return [], None
        declared = {str(c.metrics.get(wire.LOCAL_ARRAYS)) for c in valid}
        if len(declared) > 1:
            return [], "the replies declare different local-update arrays"
        if not declared:
            return [], None
        names = legacy_names(declared.pop())
        if isinstance(names, str):
            return [], names
        if not names:
            return [], f"{self.local_update.name} expects its arrays in every reply"
        return names, None

    def _next_norm_bound(
        self,
        mean_sq_norm: float | None,
        median_norm: float | None = None,
        replies: int = ANCHOR_MIN_REPLIES,
    ) -> float:
        """Return B_{t+1} from this round's sums (:func:`.secagg.next_norm_bound`).

        The first round whose typical norm is known, from at least
        :data:`~fedadapt.strategies.adapter.ANCHOR_MIN_REPLIES` ``replies``,
        anchors the norm ceiling (``max_update_norm_growth``; the anchor is
        checkpointed with the aggregator's state), which holds B_t from the
        next round on.
        """
        growth, state = self.max_update_norm_growth, self.aggregator_state
        if growth > 0 and replies >= ANCHOR_MIN_REPLIES:
            state.anchor_norm(typical_norm(mean_sq_norm, median_norm))
        return next_norm_bound(
            self.secagg_norm_bound,
            mean_sq_norm,
            self.max_update_norm,
            self.max_update_norm_ratio,
            median_norm,
            state.norm_ceiling(growth),
        )

    def secagg_halted(self, server_round: int, why: str) -> None:
        """Record a round whose SecAgg+ protocol stopped before any sum.

        No aggregate, the model kept; the round counts toward
        ``max-failed-rounds`` like any round without a usable aggregate.
        """
        self.run_sums(server_round, [], self._sent, None, why)

    def _output_of(
        self,
        server_round: int,
        new: Arrays,
        diagnostics: dict[str, Any],
        valid: Sequence[TrainReply],
    ) -> tuple[Parameters, dict[str, Scalar]]:
        """Return the round's model and metrics; keep w_{t+1} (both paths)."""
        assert self._sent is not None
        entry = self.round_reports[server_round]
        metrics: dict[str, Scalar] = {}
        if self.fit_metrics_aggregation_fn is not None:
            metrics = wire.without_per_reply(
                self.fit_metrics_aggregation_fn(
                    [(c.source[1].num_examples, c.source[1].metrics) for c in valid]
                )
            )
            entry["train"] = dict(metrics)
            self._observe(server_round, TRAIN, metrics)
        metrics.update(
            {f"strategy-{k}": v for k, v in diagnostics.items() if v is not None}
        )
        if self.average_last_two:
            self._iterate = new
            self._output = evaluation_average(self._sent, new)
        else:
            self._iterate, self._output = None, new
        parameters = ndarrays_to_parameters(_listed(self._output, self._sent))
        self._last_output = parameters
        return parameters, metrics

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Configure federated evaluation as Flower does (nothing when idle)."""
        if self._idle(server_round):
            return []
        return super().configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """Aggregate as Flower does; the result may feed the stop rule."""
        loss, metrics = super().aggregate_evaluate(server_round, results, failures)
        losses = {} if loss is None else {"loss": loss}
        self._observe(server_round, FEDERATED, {**losses, **metrics})
        return loss, metrics

    def evaluate(
        self, server_round: int, parameters: Parameters
    ) -> tuple[float, dict[str, Scalar]] | None:
        """Central evaluation (``evaluate_fn``) as Flower does (none when idle)."""
        if self._idle(server_round):
            return None
        scores = super().evaluate(server_round, parameters)
        if scores is not None and server_round > 0:  # the initial model: no round
            self._observe(server_round, CENTRAL, {"loss": scores[0], **scores[1]})
        return scores

    def _iterate_state(self) -> tuple[Arrays, Arrays] | None:
        """Return (returned model, w_{t+1}) with ``average_last_two``, else None."""
        if self._iterate is None or self._output is None:
            return None
        return self._output, self._iterate


def _legacy_class(algorithm: Algorithm) -> type[Any]:
    return algorithm.strategy_class(
        LegacyRuleStrategy,
        LegacyFedAvgKwargs,
        module=__name__,
        legacy=True,
        flower="flwr.server.strategy.FedAvg",
    )


#: the legacy class of every declared algorithm, by class name: generated
#: from :data:`~fedadapt.strategies.ALGORITHMS`, so a new algorithm has one
#: without an edit here
CLASSES: dict[str, type[Any]] = {
    algorithm.title: _legacy_class(algorithm)
    for algorithm in map(ALGORITHMS.get, ALGORITHMS.names())
}
globals().update(CLASSES)

__all__ = [*sorted(CLASSES), "FederationFailedError", "LegacyRuleStrategy"]


def __getattr__(name: str) -> type[Any]:
    """Return the legacy class ``name`` (typed for the generated ones)."""
    try:
        return CLASSES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
