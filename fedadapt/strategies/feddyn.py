"""FedDyn (Acar et al., ICLR 2021): server rule, server half, declaration.

Paper: "Federated Learning Based on Dynamic Regularization", Algorithm 1.
Each round t the server sends θ^{t−1} to the participating clients P_t
(of m in all). Client k minimises

    L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + (α/2)‖θ − θ^{t−1}‖²        (line 5)

from θ^{t−1}, and keeps its "gradient state"

    ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α(θ_k^t − θ^{t−1})          (line 6)

(0 before its first round). The server keeps h (0 initially) and sets

    h^t = h^{t−1} − α (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1})          (line 8)
    θ^t = (1/|P_t|) Σ_{k∈P_t} θ_k^t − (1/α) h^t                   (line 9)

Both halves of the algorithm are declared here, sharing the one
hyperparameter α: the rule :class:`FedDynRule` (lines 8-9) and the server
half :class:`FedDynLocal` of the client part, which sends α to the
clients; the client half (line 5's extra gradient terms, line 6's state)
is :class:`fedadapt.client.feddyn.FedDynClient`. The declaration
:data:`FEDDYN` builds both from the same checked α.

Choices where the paper is silent or loose (ours):

- m is the number of nodes the round was sampled from (the federation's
  client count as the server knows it: connected nodes, Message API, or
  available clients, legacy API), :attr:`RoundStatistics.num_nodes`; when
  unknown (``rule.step`` without ``num_nodes``) m = |P_t|, full
  participation. m is never below |P_t|.
- The mean of line 9 is uniform over P_t (the paper's 1/|P_t|); with
  ``num-examples`` the paper's (1/m)Σ would no longer be |P_t|/m times the
  mean, so the rule has no ``weighting`` choice.
- With Δ̄ = (1/|P_t|) Σ (θ_k^t − θ^{t−1}), lines 8-9 read
  h^t = h^{t−1} − α(|P_t|/m)Δ̄ and θ^t = θ^{t−1} + Δ̄ − h^t/α: the rule
  sees the round through Δ̄ alone, as every fedadapt rule, so robust
  aggregation, clipping and SecAgg+ sums apply unchanged.
- h covers the trained (adaptive) arrays; BatchNorm buffers and integer
  arrays are averaged (``plain_average``), as in every rule.

Pure NumPy (no Flower, no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from numpy.typing import NDArray

from fedadapt._validation import check_scalar
from fedadapt.strategies.core.base import (
    Arrays,
    RoundStatistics,
    ServerRule,
    sq_norm,
    zeros_like,
)
from fedadapt.strategies.declaration import Algorithm, Paper, Param, message_class
from fedadapt.strategies.local_update import LocalUpdate
from fedadapt.strategies.param import Scalar

__all__ = ["ALPHA", "FEDDYN", "FedDyn", "FedDynLocal", "FedDynRule"]

#: α of the dynamic regulariser, declared once: the rule's, the clients'
ALPHA = Param(
    "alpha",
    0.01,
    "α > 0 of the dynamic regulariser (α/2)‖θ − θ^{t−1}‖² and of the server's "
    "correction h/α.",
    "FedDyn §4 (α searched in {0.1, 0.01, 0.001})",
    low=0.0,
    low_open=True,
)


class FedDynRule(ServerRule):
    """FedDyn's server step, Algorithm 1 lines 8-9.

    ``h ← h − α(|P_t|/m)Δ̄`` then ``θ ← θ + Δ̄ − h/α``, with Δ̄ the uniform
    mean update of the round's |P_t| clients and m =
    :attr:`RoundStatistics.num_nodes` (|P_t| when unknown; see the module
    docstring). Diagnostics: ``feddyn-h-norm`` ‖h‖ and
    ``feddyn-participation`` |P_t|/m.

    Parameters
    ----------
    alpha : float (default: 0.01)
        α > 0 (FedDyn §4).
    plain_average : Callable[[str], bool] | None (default: None)
        See :class:`~fedadapt.strategies.core.ServerRule`.
    """

    def __init__(
        self,
        *,
        alpha: float = 0.01,
        plain_average: Callable[[str], bool] | None = None,
    ) -> None:
        super().__init__(weighting="uniform", plain_average=plain_average)
        self.alpha = check_scalar("alpha", alpha, low=0, low_inclusive=False)
        self.h: Arrays | None = None

    def update(
        self, current: Arrays, stats: RoundStatistics
    ) -> tuple[Arrays, dict[str, float]]:
        """Lines 8-9: update h from the round's Δ̄, step to mean − h/α."""
        clients = stats.num_clients
        total = max(stats.num_nodes or clients, clients)  # m ≥ |P_t|
        share = clients / total
        delta = stats.mean_update
        if self.h is None:
            self.h = zeros_like(current)
        self.h = {k: h - self.alpha * share * delta[k] for k, h in self.h.items()}
        new = {k: x + delta[k] - self.h[k] / self.alpha for k, x in current.items()}
        return new, {
            "feddyn-h-norm": math.sqrt(sq_norm(self.h)),
            "feddyn-participation": share,
        }

    def _state(self) -> dict[str, Any]:
        return {"h": self.h}

    def _load(self, state: Mapping[str, Any]) -> None:
        self.h = state["h"]


class FedDynLocal(LocalUpdate):
    """FedDyn's client part, server half: sends ``feddyn.alpha``, nothing else.

    Every FedDyn strategy runs it (``FedDyn().local_update``); the clients'
    gradient states stay on the clients (their ``Context.state``), so no
    arrays travel besides the model. The client half is
    :class:`fedadapt.client.feddyn.FedDynClient`.

    Parameters
    ----------
    alpha : float (default: 0.01)
        α > 0, the same as the strategy's rule.
    """

    name: ClassVar[str] = "feddyn"
    params: ClassVar[tuple[Param, ...]] = (ALPHA,)
    client_module: ClassVar[str | None] = "fedadapt.client.feddyn"

    def __init__(self, alpha: float = float(ALPHA.default)) -> None:
        self.alpha = float(ALPHA.check(alpha))

    def configure(
        self, server_round: int, model: Mapping[str, NDArray[Any]], num_nodes: int
    ) -> tuple[dict[str, Scalar], Arrays]:
        """Send α; the clients take θ^{t−1} from the model itself."""
        return {self.key(ALPHA): self.alpha}, {}


FEDDYN = Algorithm(
    name="feddyn",
    title="FedDyn",
    summary="FedDyn: dynamic regularisation on the clients, h-corrected mean.",
    rule=FedDynRule,
    local_update=FedDynLocal,
    paper=Paper(
        "Acar et al. 2021",
        "Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, *Federated Learning "
        "Based on Dynamic Regularization*, ICLR 2021 (Algorithm 1)",
    ),
    server_step="h ← h − α(\\|P_t\\|/m)Δ̄; θ ← θ + Δ̄ − h/α; clients add "
    "−⟨g_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖² and keep g_k",
    notes="""
        Both halves share α: the rule (lines 8-9) and the local update
        :class:`~fedadapt.strategies.feddyn.FedDynLocal`, which the strategy
        always runs (``local_update`` given too: both, combined); fedadapt's
        clients apply the client half (lines 5-6). m is the number of nodes
        the round sampled from (``stats.num_nodes``).
    """,
    params=(ALPHA,),
)

FedDyn = message_class(FEDDYN, __name__)
