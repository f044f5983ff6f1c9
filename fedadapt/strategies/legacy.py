"""The same strategies for Flower's legacy API (``NumPyClient`` + ``server_fn``).

:class:`LegacyRuleStrategy` is ``flwr.server.strategy.FedAvg`` (so sampling,
``on_fit_config_fn``, ``evaluate_fn`` and failure handling stay Flower's)
with ``aggregate_fit`` replaced by reply screening + a framework-free rule of
:mod:`fedadapt.strategies.core`: the same code path as the Message API's
:class:`~fedadapt.strategies.RuleStrategy`. The public classes only build
the rule; their defaults follow Flower's legacy classes (τ = 1e-9 for
FedAdagrad and FedAdam).

Legacy parameters are an ordered list of arrays. Pass ``array_names`` (the
model's ``state_dict`` keys, in order) so that FedExP/FedDuA recognise
BatchNorm buffers by name, average them and keep them out of the norms, as
the Message API does; clients report ``update-sq-norm`` over the parameters,
which is then exactly that set. Without names the arrays are keyed ``"0"``,
``"1"``, … and every float array goes through the rule (the server's own
norms then cover them all). The weight is ``FitRes.num_examples``. The
rule's diagnostics are returned in the fit metrics, prefixed ``strategy-``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Unpack

from flwr.common import (
    EvaluateIns,
    FitIns,
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg as _FlowerFedAvg

from fedadapt.strategies._screening import (
    Candidate,
    RuleHost,
    ScreeningKwargs,
    evaluation_average,
    failed_reply,
)
from fedadapt.strategies.core import (
    Arrays,
    FedAdagradRule,
    FedAdamRule,
    FedAvgRule,
    FedDuARule,
    FedExPRule,
    FedLAMBRule,
    FedYogiRule,
    ServerRule,
)

WEIGHT_KEY = "num-examples"


class LegacyFedAvgKwargs(ScreeningKwargs, total=False):
    """Arguments of ``flwr.server.strategy.FedAvg``, passed through unchanged.

    Plus ``array_names`` (see :class:`LegacyRuleStrategy`) and fedadapt's
    ``secure_aggregation``, ``max_update_norm``, ``max_failed_rounds``
    (see :class:`~fedadapt.strategies._screening.RuleHost`).
    """

    array_names: Sequence[str] | None
    secure_aggregation: bool
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


def _listed(arrays: Arrays, order: Arrays) -> NDArrays:
    """List ``arrays`` in the key order of ``order``."""
    return [arrays[k] for k in order]


class LegacyRuleStrategy(RuleHost, _FlowerFedAvg):
    """Flower's legacy FedAvg with its aggregation replaced by a fedadapt rule.

    Parameters
    ----------
    rule : ServerRule
        The update rule, e.g. ``FedAdamRule(eta=0.01)``.
    array_names : Sequence[str] | None (default: None)
        Names of the parameter list's arrays (the model's ``state_dict``
        keys); BatchNorm buffers are then recognised by name.
    average_last_two, secure_aggregation, max_update_norm, max_failed_rounds
        See :class:`~fedadapt.strategies._screening.RuleHost`.
    **kwargs
        Any argument of ``flwr.server.strategy.FedAvg``.

    A rule's client state (Fed-LAMB's second moments) travels in the
    parameter list after the model's arrays: server → client from the
    second round on (:meth:`~fedadapt.strategies.core.ServerRule.broadcast_state`,
    in its key order), client → server always, one array per trainable
    parameter (see :mod:`fedadapt.client.numpy_client`). The model part
    has the length of the global model's list; the rest is keyed by
    position ``"0"``, ``"1"``, ...
    """

    client_state_named = False

    def __init__(
        self,
        rule: ServerRule,
        *,
        average_last_two: bool = False,
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        names = kwargs.pop("array_names", None)
        super().__init__(rule, average_last_two=average_last_two, **kwargs)
        self.array_names = None if names is None else list(names)
        self._sent: Arrays | None = None
        self._last_output: Parameters | None = None
        self._evaluation: Parameters | None = None
        self._evaluation_pair: tuple[Arrays, Arrays] | None = None

    def __repr__(self) -> str:
        """Flower's strategy name line: the rule with its hyperparameters."""
        return f"{type(self).__name__}({self.rule!r})"

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Remember the global arrays, then sample and configure as Flower does."""
        model = parameters_to_ndarrays(parameters)
        self._sent = _keyed(model, self.array_names)
        pairs = super().configure_fit(server_round, parameters, client_manager)
        state = self.rule.broadcast_state()
        if state is None:
            return pairs
        packed = ndarrays_to_parameters(model + list(state.values()))
        return [(proxy, FitIns(packed, ins.config)) for proxy, ins in pairs]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Screen results, apply the rule; ``(None, {})`` keeps the model."""
        candidates: list[Candidate | str] = [_failure(f) for f in failures]
        size = len(self._sent or {})
        with_state = self.rule.client_state_key is not None
        for proxy, res in results:
            reply = {**res.metrics, WEIGHT_KEY: res.num_examples}
            arrays = parameters_to_ndarrays(res.parameters)
            model, rest = (arrays[:size], arrays[size:]) if with_state else (arrays, [])
            candidates.append(
                Candidate(
                    proxy.cid, _keyed(model, self.array_names), reply, (proxy, res),
                    client_state=_keyed(rest) if with_state else None,
                )
            )  # fmt: skip
        # Flower's contract: with failures and accept_failures=False, no update
        keep = bool(failures) and not self.accept_failures
        new, valid = self.run_rule(
            server_round, candidates, None if keep else self._sent, WEIGHT_KEY
        )
        if new is None or self._sent is None:
            return None, {}
        entry = self.round_reports[server_round]
        diagnostics = entry["diagnostics"]
        metrics: dict[str, Scalar] = {}
        if self.fit_metrics_aggregation_fn is not None:
            metrics = dict(
                self.fit_metrics_aggregation_fn(
                    [(c.source[1].num_examples, c.source[1].metrics) for c in valid]
                )
            )
            entry["train"] = dict(metrics)
        metrics.update(
            {f"strategy-{k}": v for k, v in diagnostics.items() if v is not None}
        )
        parameters = ndarrays_to_parameters(_listed(new, self._sent))
        self._last_output = parameters
        self._evaluation = None
        self._evaluation_pair = (self._sent, new) if self.average_last_two else None
        return parameters, metrics

    def evaluation_parameters(self, parameters: Parameters) -> Parameters:
        """Return (w_t + w_{t+1})/2 for our latest output when averaging is on."""
        if self._evaluation_pair is None or parameters is not self._last_output:
            return parameters
        if self._evaluation is None:  # built on first use only
            average = evaluation_average(*self._evaluation_pair)
            order = self._evaluation_pair[0]
            self._evaluation = ndarrays_to_parameters(_listed(average, order))
        return self._evaluation

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Configure federated evaluation of the evaluation model."""
        return super().configure_evaluate(
            server_round, self.evaluation_parameters(parameters), client_manager
        )

    def evaluate(
        self, server_round: int, parameters: Parameters
    ) -> tuple[float, dict[str, Scalar]] | None:
        """Central evaluation (``evaluate_fn``) of the evaluation model."""
        return super().evaluate(server_round, self.evaluation_parameters(parameters))


class FedAvg(LegacyRuleStrategy):
    """Legacy FedAvg (num-examples weighted) with screening; Flower's arguments."""

    def __init__(
        self, *, weighting: str = "num_examples", **kwargs: Unpack[LegacyFedAvgKwargs]
    ) -> None:
        super().__init__(FedAvgRule(weighting=weighting), **kwargs)


class FedAvgM(LegacyRuleStrategy):
    """Legacy FedAvgM: server learning rate and heavy-ball momentum."""

    def __init__(
        self,
        *,
        server_learning_rate: float = 1.0,
        server_momentum: float = 0.0,
        weighting: str = "num_examples",
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        rule = FedAvgRule(
            server_lr=server_learning_rate,
            server_momentum=server_momentum,
            weighting=weighting,
        )
        super().__init__(rule, **kwargs)


class FedAdagrad(LegacyRuleStrategy):
    """Legacy FedAdagrad (Flower's legacy τ default, 1e-9)."""

    def __init__(
        self,
        *,
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        tau: float = 1e-9,
        weighting: str = "num_examples",
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        super().__init__(
            FedAdagradRule(eta=eta, tau=tau, weighting=weighting), **kwargs
        )
        self.eta_l = eta_l


class FedAdam(LegacyRuleStrategy):
    """Legacy FedAdam (Flower's legacy τ default, 1e-9; Flower bias correction)."""

    def __init__(
        self,
        *,
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-9,
        bias_correction: str = "flower",
        weighting: str = "num_examples",
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        rule = FedAdamRule(
            eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau,
            bias_correction=bias_correction, weighting=weighting,
        )  # fmt: skip
        super().__init__(rule, **kwargs)
        self.eta_l = eta_l


class FedYogi(LegacyRuleStrategy):
    """Legacy FedYogi."""

    def __init__(
        self,
        *,
        eta: float = 1e-2,
        eta_l: float = 0.0316,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        weighting: str = "num_examples",
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        rule = FedYogiRule(
            eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau, weighting=weighting
        )
        super().__init__(rule, **kwargs)
        self.eta_l = eta_l


class FedExP(LegacyRuleStrategy):
    """Legacy FedExP / FedExPM; arguments as :class:`fedadapt.strategies.FedExP`."""

    def __init__(
        self,
        *,
        epsilon: float = 1e-3,
        server_momentum: float = 0.0,
        form: str = "original",
        eps_form: str = "paper",
        eps_decay: float = 1.0,
        weighting: str = "uniform",
        average_last_two: bool = True,
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        rule = FedExPRule(
            epsilon=epsilon, server_momentum=server_momentum, form=form,
            eps_form=eps_form, eps_decay=eps_decay, weighting=weighting,
        )  # fmt: skip
        super().__init__(rule, average_last_two=average_last_two, **kwargs)


class FedDuA(LegacyRuleStrategy):
    """Legacy FedDuA; arguments as :class:`fedadapt.strategies.FedDuA`."""

    def __init__(
        self,
        *,
        variant: str = "adam",
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        epsilon: float = 1e-9,
        epsilon_g: float = 0.0,
        weighting: str = "uniform",
        average_last_two: bool = True,
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        rule = FedDuARule(
            variant=variant, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            epsilon_g=epsilon_g, weighting=weighting,
        )  # fmt: skip
        super().__init__(rule, average_last_two=average_last_two, **kwargs)


class FedLAMB(LegacyRuleStrategy):
    """Legacy server of Fed-LAMB / Fed-AMS: model mean and v̂ = max(v̂, mean v).

    Second moments travel after the model's arrays in the parameter list
    (see :class:`LegacyRuleStrategy`).
    """

    def __init__(
        self,
        *,
        eps: float = 1e-8,
        weighting: str = "uniform",
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        super().__init__(FedLAMBRule(eps=eps, weighting=weighting), **kwargs)


__all__ = [
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedDuA",
    "FedExP",
    "FedLAMB",
    "FedYogi",
    "LegacyRuleStrategy",
]
