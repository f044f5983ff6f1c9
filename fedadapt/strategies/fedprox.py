"""FedProx's server half (Li et al., MLSys 2020): send μ, nothing else.

FedProx changes only the clients' local objective (Algorithm 2, line 5):
client k approximately minimises

    h_k(w; w_t) = F_k(w) + (μ/2) ‖w − w_t‖²

from the global model w_t; the server aggregates as its strategy does
(FedAvg in the paper; any fedadapt strategy here). The client half is
:class:`fedadapt.client.fedprox.FedProxClient`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from numpy.typing import NDArray

from fedadapt.strategies.core import Arrays
from fedadapt.strategies.local_update import LOCAL_UPDATES, LocalUpdate
from fedadapt.strategies.param import Paper, Param, Scalar

#: μ of the proximal term, declared once (class default, run config, docs)
MU = Param(
    "mu",
    0.01,
    "μ of the proximal term (μ/2)‖w − w_t‖² (Li et al. 2020, Alg. 2); 0 trains "
    "as the plain client, bit for bit.",
    "the Δ-SGD paper's official FedProx run script (FedDuA's grid: 1e-3 … 1)",
    low=0.0,
)


@LOCAL_UPDATES.register("fedprox")
class FedProx(LocalUpdate):
    """FedProx's proximal term for any strategy: ``local_update=FedProx(0.01)``.

    Parameters
    ----------
    mu : float (default: 0.01)
        μ ≥ 0 of the proximal term (μ/2)‖w − w_t‖² (Li et al. 2020, Alg. 2).
        Default 0.01: the Δ-SGD paper's official run script with FedProx;
        FedDuA's baseline grid is {1e-3, 1e-2, 1e-1, 1}. μ = 0 trains as the
        plain client, bit for bit.
    """

    name: ClassVar[str] = "fedprox"
    client_module: ClassVar[str | None] = "fedadapt.client.fedprox"
    paper: ClassVar[Paper | None] = Paper(
        "Li et al. 2020",
        "Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, *Federated Optimization in "
        "Heterogeneous Networks*, MLSys 2020 (Algorithm 2)",
    )
    params: ClassVar[tuple[Param, ...]] = (MU,)

    def __init__(self, mu: float = float(MU.default)) -> None:
        self.mu = float(MU.check(mu))

    def configure(
        self, server_round: int, model: Mapping[str, NDArray[Any]], num_nodes: int
    ) -> tuple[dict[str, Scalar], Arrays]:
        """Send ``fedprox.mu``; the clients keep w_t from the model itself."""
        return {self.key(MU): self.mu}, {}
