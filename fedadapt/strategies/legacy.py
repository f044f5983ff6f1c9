"""The same strategies for Flower's legacy API (``NumPyClient`` + ``server_fn``).

Each class subclasses its ``flwr.server.strategy`` counterpart (so sampling,
``on_fit_config_fn``, ``evaluate_fn`` and failure handling stay Flower's) and
replaces ``aggregate_fit`` with reply screening + the framework-free rule of
:mod:`fedadapt.strategies.core` — the same code path as the Message API.

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

import numpy as np
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
from flwr.server.strategy import FedAdagrad as _FlowerFedAdagrad
from flwr.server.strategy import FedAdam as _FlowerFedAdam
from flwr.server.strategy import FedAvg as _FlowerFedAvg
from flwr.server.strategy import FedAvgM as _FlowerFedAvgM
from flwr.server.strategy import FedYogi as _FlowerFedYogi

from fedadapt.strategies._screening import (
    Candidate,
    RuleHost,
    ScreeningKwargs,
    evaluation_average,
)
from fedadapt.strategies.core import (
    Arrays,
    FedAdagradRule,
    FedAdamRule,
    FedAvgRule,
    FedDuARule,
    FedExPRule,
    FedYogiRule,
)
from fedadapt.strategies.fedlamb import next_v_hat

WEIGHT_KEY = "num-examples"


class LegacyFedAvgKwargs(ScreeningKwargs, total=False):
    """Arguments of ``flwr.server.strategy.FedAvg``, passed through unchanged.

    Plus ``array_names`` (see :class:`LegacyRuleStrategy`) and fedadapt's
    ``secure_aggregation``, ``max_update_norm``, ``max_failed_rounds``
    (see :class:`~fedadapt.strategies._screening.RuleHost`).
    """

    array_names: Sequence[str] | None

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


def _keyed(arrays: NDArrays, names: Sequence[str] | None = None) -> Arrays:
    """Key a parameter list by ``names`` (same length), else by position."""
    if names is not None and len(names) == len(arrays):
        return dict(zip(names, arrays, strict=True))
    return {str(i): a for i, a in enumerate(arrays)}


def _listed(arrays: Arrays, order: Arrays) -> NDArrays:
    """List ``arrays`` in the key order of ``order``."""
    return [arrays[k] for k in order]


class LegacyRuleStrategy(RuleHost):
    """Mixin for ``flwr.server.strategy.FedAvg`` subclasses (put it first).

    Attributes as :class:`fedadapt.strategies.RuleStrategy`: ``rule``,
    ``average_last_two`` and ``round_reports``.

    Parameters
    ----------
    array_names : Sequence[str] | None (default: None)
        Names of the parameter list's arrays (the model's ``state_dict``
        keys); BatchNorm buffers are then recognised by name.
    """

    accept_failures: bool
    fit_metrics_aggregation_fn: Callable[..., dict[str, Scalar]] | None

    def __init__(
        self, *args: Any, array_names: Sequence[str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.array_names = None if array_names is None else list(array_names)
        self._sent: Arrays | None = None
        self._last_output: Parameters | None = None
        self._evaluation: Parameters | None = None
        self._evaluation_pair: tuple[Arrays, Arrays] | None = None

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Remember the global arrays, then sample and configure as Flower does."""
        self._sent = _keyed(parameters_to_ndarrays(parameters), self.array_names)
        return super().configure_fit(server_round, parameters, client_manager)  # type: ignore[misc]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Screen results, apply the rule; ``(None, {})`` keeps the model."""
        candidates: list[Candidate | str] = [repr(f) for f in failures]
        for proxy, res in results:
            reply = {**res.metrics, WEIGHT_KEY: res.num_examples}
            arrays = _keyed(parameters_to_ndarrays(res.parameters), self.array_names)
            candidates.append(Candidate(proxy.cid, arrays, reply, (proxy, res)))
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
        return super().configure_evaluate(  # type: ignore[misc]
            server_round, self.evaluation_parameters(parameters), client_manager
        )

    def evaluate(
        self, server_round: int, parameters: Parameters
    ) -> tuple[float, dict[str, Scalar]] | None:
        """Central evaluation (``evaluate_fn``) of the evaluation model."""
        return super().evaluate(server_round, self.evaluation_parameters(parameters))  # type: ignore[misc]


class FedAvg(LegacyRuleStrategy, _FlowerFedAvg):
    """Legacy FedAvg (num-examples weighted) with screening; Flower's arguments."""

    def __init__(
        self, *, weighting: str = "num_examples", **kwargs: Unpack[LegacyFedAvgKwargs]
    ) -> None:
        super().__init__(**kwargs)
        self.rule = FedAvgRule(weighting=weighting)


class FedAvgM(LegacyRuleStrategy, _FlowerFedAvgM):
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
        super().__init__(
            server_learning_rate=server_learning_rate,
            server_momentum=server_momentum,
            **kwargs,
        )
        self.rule = rule


class FedAdagrad(LegacyRuleStrategy, _FlowerFedAdagrad):
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
        rule = FedAdagradRule(eta=eta, tau=tau, weighting=weighting)
        super().__init__(eta=eta, eta_l=eta_l, tau=tau, **kwargs)
        self.rule = rule


class FedAdam(LegacyRuleStrategy, _FlowerFedAdam):
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
        super().__init__(
            eta=eta, eta_l=eta_l, beta_1=beta_1, beta_2=beta_2, tau=tau, **kwargs
        )
        self.rule = rule


class FedYogi(LegacyRuleStrategy, _FlowerFedYogi):
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
        super().__init__(
            eta=eta, eta_l=eta_l, beta_1=beta_1, beta_2=beta_2, tau=tau, **kwargs
        )
        self.rule = rule


class FedExP(LegacyRuleStrategy, _FlowerFedAvg):
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
        super().__init__(**kwargs)
        self.rule = rule
        self.average_last_two = bool(average_last_two)


class FedDuA(LegacyRuleStrategy, _FlowerFedAvg):
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
        super().__init__(**kwargs)
        self.rule = rule
        self.average_last_two = bool(average_last_two)


class FedLAMB(LegacyRuleStrategy, _FlowerFedAvg):
    """Legacy server of Fed-LAMB / Fed-AMS: model mean and v̂ = max(v̂, mean v).

    Packing (see :mod:`fedadapt.client.numpy_client`): the parameter list is
    the model's arrays, followed (from round 2 on, server → client; always,
    client → server) by one second-moment array per trainable parameter.
    The model part has the length of ``initial_parameters``.
    """

    def __init__(
        self,
        *,
        eps: float = 1e-8,
        weighting: str = "uniform",
        **kwargs: Unpack[LegacyFedAvgKwargs],
    ) -> None:
        rule = FedAvgRule(weighting=weighting)
        super().__init__(**kwargs)
        self.rule = rule
        self.eps = eps
        self.v_hat: Arrays | None = None
        self._moments: dict[int, Arrays] = {}

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Send the model, with v̂ appended after round 1."""
        pairs = super().configure_fit(server_round, parameters, client_manager)
        if self.v_hat is None:
            return pairs
        packed = ndarrays_to_parameters(
            parameters_to_ndarrays(parameters)
            + [self.v_hat[str(i)] for i in range(len(self.v_hat))]
        )
        return [(proxy, FitIns(packed, ins.config)) for proxy, ins in pairs]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Split each result into model and moments, then aggregate both."""
        size = len(self._sent or {})
        self._moments, unpacked = {}, []
        for proxy, res in results:
            arrays = parameters_to_ndarrays(res.parameters)
            model = FitRes(
                res.status, ndarrays_to_parameters(arrays[:size]), res.num_examples,
                res.metrics,
            )  # fmt: skip
            self._moments[id(model)] = _keyed(arrays[size:])
            unpacked.append((proxy, model))
        return super().aggregate_fit(server_round, unpacked, failures)

    def check_reply(self, candidate: Candidate) -> str | None:
        """Moments must be present, finite, >= 0 and shaped like v̂."""
        moments = self._moments.get(id(candidate.source[1]))
        if not moments:
            return "no second moments after the model arrays"
        if self.v_hat is not None and any(
            k not in self.v_hat or self.v_hat[k].shape != v.shape
            for k, v in moments.items()
        ):
            return "second moments do not match v̂'s shapes"
        for v in moments.values():
            if v.dtype.kind != "f" or not np.all(np.isfinite(v)) or np.any(v < 0):
                return "second moments must be finite and >= 0"
        return None

    def after_aggregate(self, valid: list[Candidate]) -> dict[str, float | None]:
        """v̂_r = max(v̂_{r−1}, Σω_i v_i) over the used results."""
        self.v_hat, diagnostics = next_v_hat(
            self.v_hat,
            [self._moments[id(c.source[1])] for c in valid],
            [float(c.metrics[WEIGHT_KEY]) for c in valid],
            self.rule.weighting,
            self.eps,
        )
        return diagnostics

    def state_dict(self) -> dict[str, Any]:
        """Model-averaging state plus v̂."""
        return {**super().state_dict(), "v_hat": self.v_hat}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        super().load_state_dict(state)
        self.v_hat = state["v_hat"]


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
