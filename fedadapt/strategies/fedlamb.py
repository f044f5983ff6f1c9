"""Server side of Fed-LAMB and Fed-AMS (layer-wise locally adaptive FL).

Paper: shared/papers/fed-lamb.txt, Algorithm 1 lines 13-16; spec §3.3-3.4.
Per round the server averages the client models (uniformly by default,
A-L6) and keeps v̂_r = max(v̂_{r−1}, Σω_i v_i) of the clients' raw second
moments, sent back with the model. Message API: v̂ travels to the clients,
and each v_i back, as a second ArrayRecord named ``second-moments`` keyed by
parameter name; in round 1 none is sent and clients start from v̂_0 = ε·1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Unpack

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy

from fedadapt._validation import check_scalar
from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies._screening import Candidate
from fedadapt.strategies._second_moments import aggregate_second_moments
from fedadapt.strategies.core import Arrays, FedAvgRule, client_weights

SECOND_MOMENTS_KEY = "second-moments"


def check_second_moments(
    moments: Arrays | None, reference: Arrays | None
) -> str | None:
    """Return why client second moments are unusable, or None.

    They must exist, name parameters of the global model with its shapes,
    and be finite and non-negative.
    """
    if moments is None:
        return f"no '{SECOND_MOMENTS_KEY}' record (is the client Fed-LAMB/Fed-AMS?)"
    for name, v in moments.items():
        ref = None if reference is None else reference.get(name)
        if ref is None or ref.shape != v.shape:
            return f"second moment '{name}' does not match a model parameter"
        if v.dtype.kind != "f" or not np.all(np.isfinite(v)) or np.any(v < 0):
            return f"second moment '{name}' must be finite and >= 0"
    return None


def next_v_hat(
    v_hat: Arrays | None,
    moments: list[Arrays],
    weights: list[float],
    weighting: str,
    eps: float,
) -> tuple[Arrays, dict[str, float | None]]:
    """Return v̂_r = max(v̂_{r−1}, Σω_i v_i) and its diagnostics (spec §3.3).

    ``weights`` are the replies' ``num-examples``; ω follows ``weighting``.
    """
    omega = client_weights(weights, weighting)
    new = aggregate_second_moments(v_hat, moments, weights=list(omega), eps=eps)
    flat = np.concatenate([v.ravel() for v in new.values()])
    return new, {"v-hat-mean": float(flat.mean())}


class FedLAMB(RuleStrategy, flwr_strategy.FedAvg):
    """Model averaging plus v̂ = max(v̂, mean v) (Fed-LAMB and Fed-AMS servers).

    Parameters
    ----------
    eps : float (default: 1e-8)
        ε > 0 of the clients' optimizer; v̂_0 = ε·1 (LAMB Alg. 1 line 2).
    weighting : str (default: "uniform")
        ω for both the models and v (LAMB Alg. 1 line 15; A-L6).
    **kwargs
        Any argument of ``flwr.serverapp.strategy.FedAvg``.
    """

    def __init__(
        self,
        *,
        eps: float = 1e-8,
        weighting: str = "uniform",
        **kwargs: Unpack[FedAvgKwargs],
    ) -> None:
        rule = FedAvgRule(weighting=weighting)
        super().__init__(**kwargs)
        self.rule = rule
        self.eps = check_scalar("eps", eps, low=0, low_inclusive=False)
        self.v_hat: Arrays | None = None
        self._moments: dict[int, Arrays] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global model and, after round 1, v̂."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if self.v_hat is not None:
            record = ArrayRecord({k: Array(v) for k, v in self.v_hat.items()})
            for message in messages:
                message.content[SECOND_MOMENTS_KEY] = record
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take each reply's v out of it, then screen and average as usual."""
        replies = list(replies)
        self._moments = {}
        for message in replies:
            if message.has_error():
                continue
            if SECOND_MOMENTS_KEY in message.content.array_records:
                record = message.content.array_records[SECOND_MOMENTS_KEY]
                self._moments[id(message)] = {k: v.numpy() for k, v in record.items()}
                del message.content[SECOND_MOMENTS_KEY]
        return super().aggregate_train(server_round, replies)

    def check_reply(self, candidate: Candidate) -> str | None:
        """Reject replies whose second moments are missing or invalid."""
        return check_second_moments(self._moments.get(id(candidate.source)), self._sent)

    def after_aggregate(self, valid: list[Candidate]) -> dict[str, float | None]:
        """v̂_r = max(v̂_{r−1}, Σω_i v_i) over the used replies (spec §3.3)."""
        self.v_hat, diagnostics = next_v_hat(
            self.v_hat,
            [self._moments[id(c.source)] for c in valid],
            [float(c.metrics[self.weighted_by_key]) for c in valid],
            self.rule.weighting,
            self.eps,
        )
        return diagnostics

    def state_dict(self) -> dict[str, Any]:
        """Model-averaging state plus v̂ (must be checkpointed, spec §3.3)."""
        return {**super().state_dict(), "v_hat": self.v_hat}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        super().load_state_dict(state)
        self.v_hat = state["v_hat"]
