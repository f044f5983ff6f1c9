"""SCAFFOLD's server half (Karimireddy et al., ICML 2020, Algorithm 1, option II).

The server keeps the control variate c (0 initially) and sends it to the
sampled clients S with the model x (line 6). Client i returns, besides its
model, Δc_i = c_i⁺ − c_i (line 13); after the round

    c ← c + (1/N) Σ_{i∈S} Δc_i                          (line 17)

with N the number of nodes the round sampled from (an unweighted sum, as
the paper's; the ``weights`` are not used). The model step
x ← x + η_g · mean_S Δy_i (line 16) belongs to the strategy, not to this
class: ``fedavg`` is η_g = 1 (with Flower's num-examples weighting),
``fedavgm`` with ``server-momentum`` 0 gives any η_g
(``server-learning-rate``), and ``feddua`` replaces line 16 by FedDuA's step
(FedDuA §5, Fig. 4: "FedDuA + SCAFFOLD"; our reading, the paper gives no
box). The client half is :class:`fedadapt.client.scaffold.ScaffoldClient`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from fedadapt.strategies.core import Arrays
from fedadapt.strategies.local_update import LOCAL_UPDATES, LocalUpdate
from fedadapt.strategies.param import Paper, Param, Scalar


@LOCAL_UPDATES.register("scaffold")
class Scaffold(LocalUpdate):
    """SCAFFOLD's control variates for any strategy: ``local_update=Scaffold()``.

    No hyperparameters: η_l is the clients' learning rate, η_g the
    strategy's server step (see the module docstring). The state is c, one
    array per trainable model array (created from the first used replies:
    c = 0 before, so round 1 trains as plain local SGD). Diagnostic
    ``scaffold-c-norm``: ‖c‖ after the round.
    """

    name: ClassVar[str] = "scaffold"
    client_module: ClassVar[str | None] = "fedadapt.client.scaffold"
    paper: ClassVar[Paper | None] = Paper(
        "Karimireddy et al. 2020",
        "Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, *SCAFFOLD: Stochastic "
        "Controlled Averaging for Federated Learning*, ICML 2020 (Algorithm 1, "
        "option II)",
    )
    params: ClassVar[tuple[Param, ...]] = ()
    #: under SecAgg+, c adds the unweighted Σ_{i∈S} Δc_i = |S|·(uniform mean)
    secure_weighting: ClassVar[str | None] = "uniform"

    def __init__(self) -> None:
        self.c: dict[str, NDArray[Any]] | None = None
        self.num_nodes = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._names: frozenset[str] | None = None  # the round's Δc_i names

    def configure(
        self, server_round: int, model: Mapping[str, NDArray[Any]], num_nodes: int
    ) -> tuple[dict[str, Scalar], Arrays]:
        """Send c (nothing before the first replies: c = 0); remember N."""
        self.num_nodes = num_nodes
        self._shapes = {k: np.shape(v) for k, v in model.items()}
        self._names = None if self.c is None else frozenset(self.c)
        return {}, dict(self.c or {})

    def check_reply(
        self, arrays: Mapping[str, NDArray[Any]] | None, metrics: Mapping[str, Any]
    ) -> str | None:
        """Refuse a reply unless it has one finite Δc_i per array of c.

        Before c exists, the first reply of the round fixes the names (a
        subset of the model's arrays, with their shapes); all others must
        have the same.
        """
        if not arrays:
            return "expected Δc_i, one array per trainable model array"
        for key, value in arrays.items():
            if key not in self._shapes:
                return f"Δc_i for '{key}', which is not a model array"
            if np.shape(value) != self._shapes[key]:
                return (
                    f"Δc_i '{key}' has shape {np.shape(value)}, "
                    f"the model's {self._shapes[key]}"
                )
            if not np.issubdtype(value.dtype, np.floating):
                return f"Δc_i '{key}' is not a float array ({value.dtype})"
            if not np.all(np.isfinite(value)):
                return f"Δc_i '{key}' is not finite"
        if self._names is None:
            self._names = frozenset(arrays)
        elif set(arrays) != self._names:
            return f"expected Δc_i for {sorted(self._names)}, got {sorted(arrays)}"
        return None

    def aggregate(
        self,
        replies: Sequence[Mapping[str, NDArray[Any]] | None],
        weights: Sequence[float],
    ) -> dict[str, float]:
        """C ← c + (1/N) Σ_{i∈S} Δc_i (Algorithm 1, line 17)."""
        used = [r for r in replies if r]
        if not used:
            return {}
        if self.c is None:
            self.c = {k: np.zeros_like(a) for k, a in used[0].items()}
        num_nodes = max(self.num_nodes, len(used))  # N ≥ |S|
        for key in self.c:
            self.c[key] = self.c[key] + sum(r[key] for r in used) / num_nodes
        norm = np.sqrt(
            sum(float(np.sum(np.square(a, dtype=np.float64))) for a in self.c.values())
        )
        return {"scaffold-c-norm": float(norm)}

    def aggregate_mean(
        self, mean: Mapping[str, NDArray[Any]], num_replies: int
    ) -> dict[str, float]:
        """C ← c + (|S|/N)·mean Δc_i from SecAgg+'s uniform mean (line 17).

        Under uniform weighting (:attr:`secure_weighting`) the revealed mean
        times the |S| clients in it is line 17's Σ_{i∈S} Δc_i, so this is
        :meth:`aggregate` of |S| copies of the mean. Δc_i travel as they
        are (within ±c, step 2c/Q): they are client-specific corrections
        whose mean cancels, so no range from the last mean would hold them.
        """
        problem = self.check_reply(mean, {})
        if problem is not None:
            raise ValueError(problem)
        return self.aggregate([mean] * num_replies, [1.0] * num_replies)

    def _state(self) -> dict[str, Any]:
        return {"c": self.c}

    def _load(self, state: dict[str, Any]) -> None:
        c = state["c"]
        self.c = None if c is None else {k: np.asarray(v) for k, v in c.items()}
