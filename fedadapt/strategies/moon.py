"""MOON's server half (Li, He and Song, CVPR 2021): send μ and τ, nothing else.

MOON (model-contrastive federated learning) changes only the clients' local
objective (Algorithm 1, lines 23-27; eq. 3-4): client i minimises

    ℓ = ℓ_sup(w; (x, y)) + μ · ℓ_con,
    ℓ_con = −log( exp(sim(z, z_glob)/τ)
                  / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

with z, z_glob and z_prev the representations of x under the model being
trained, the received global model and this client's model after its
previous local training (both frozen), sim the cosine similarity. The server
aggregates as its strategy does (FedAvg in the paper; any fedadapt strategy
here) and keeps no state of its own: each client keeps its previous model.
The client half is :class:`fedadapt.client.moon.MoonClient`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from numpy.typing import NDArray

from fedadapt.strategies.core import Arrays
from fedadapt.strategies.local_update import LOCAL_UPDATES, LocalUpdate
from fedadapt.strategies.param import Paper, Param, Scalar

#: μ, the weight of the model-contrastive loss, declared once
MU = Param(
    "mu",
    1.0,
    "μ, weight of the model-contrastive loss ℓ_con (Li et al. 2021, eq. 4); 0 "
    "trains as the plain client.",
    "the Δ-SGD paper's official MOON run script (App. B.5)",
    low=0.0,
)
#: τ, the temperature of ℓ_con, declared once
TEMPERATURE = Param(
    "temperature",
    0.5,
    "τ, temperature of the model-contrastive loss ℓ_con (Li et al. 2021, eq. 3).",
    "the Δ-SGD paper's official MOON run script (App. B.5)",
    low=0.0,
    low_open=True,
)


@LOCAL_UPDATES.register("moon")
class Moon(LocalUpdate):
    """MOON's model-contrastive loss for any strategy: ``local_update=Moon()``.

    Parameters
    ----------
    mu : float (default: 1.0)
        μ ≥ 0, weight of ℓ_con (Li et al. 2021, eq. 4). Default 1: the Δ-SGD
        paper's official run script (App. B.5, Table 5). μ = 0 trains as the
        plain client, bit for bit.
    temperature : float (default: 0.5)
        τ > 0 of ℓ_con (eq. 3). Default 0.5: the Δ-SGD paper's official run
        script (App. B.5).
    """

    name: ClassVar[str] = "moon"
    client_module: ClassVar[str | None] = "fedadapt.client.moon"
    paper: ClassVar[Paper | None] = Paper(
        "Li, He, Song 2021",
        "Li, He, Song, *Model-Contrastive Federated Learning*, CVPR 2021 (Algorithm 1)",
    )
    params: ClassVar[tuple[Param, ...]] = (MU, TEMPERATURE)

    def __init__(
        self,
        mu: float = float(MU.default),
        temperature: float = float(TEMPERATURE.default),
    ) -> None:
        self.mu = float(MU.check(mu))
        self.temperature = float(TEMPERATURE.check(temperature))

    def configure(
        self, server_round: int, model: Mapping[str, NDArray[Any]], num_nodes: int
    ) -> tuple[dict[str, Scalar], Arrays]:
        """Send ``moon.mu`` and ``moon.temperature``; the model is x_t itself."""
        return {self.key(MU): self.mu, self.key(TEMPERATURE): self.temperature}, {}
