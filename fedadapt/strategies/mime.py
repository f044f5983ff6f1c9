"""Mime and MimeLite's server half (Karimireddy et al. 2020a, arXiv:2008.03606).

Algorithm 1 of the paper with SGDm (β = 0.9) as the base optimizer, as the
FedDuA paper runs it (§5, Fig. 4). The server keeps the momentum m (the
base optimizer's state s) and sends it every round; clients step with it
fixed, y ← y − η_l((1 − β)·g + β·m), where

- MimeLite: g = ∇f_i(y; ζ);
- Mime: g = ∇f_i(y; ζ) − ∇f_i(x; ζ) + c, SVRG's correction with c the mean
  full-batch gradient of the sampled clients.

Every client also sends its full-batch gradient ∇f_i(x) at the global model
x; the server updates m ← (1 − β)·mean_S ∇f_i(x) + β·m (Alg. 1, "update
optimizer state" with the SGDm rule V), while the strategy updates x as it
does (FedAvg: x ← mean_S y_i, the paper's server step; FedDuA + Mime: the
FedDuA step). The client half is :mod:`fedadapt.client.mime`.

Our choices (docs/algorithms.md):

- **One exchange per round.** Algorithm 1 computes Mime's c at x_t from the
  round's clients before their local steps, an extra round trip a Flower
  round does not have. Here c is the previous round's mean full-batch
  gradient (at x_{t−1}, the one m was updated with); round 1 has none and
  its clients take MimeLite's steps (with m = 0: y ← y − η_l(1 − β)g).
- **Weighted means.** mean_S is weighted by the replies' ``num-examples``,
  as the strategies average models (FedJAX's Mime weights by examples
  too); with equal partitions it is the paper's 1/|S| mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from fedadapt.strategies.core import Arrays
from fedadapt.strategies.local_update import LOCAL_UPDATES, LocalUpdate
from fedadapt.strategies.param import Paper, Param, Scalar

#: β of the SGDm base optimizer, declared once (class default, run config, docs)
BETA = Param(
    "beta",
    0.9,
    "β of the SGDm base optimizer: clients step y ← y − η_l((1 − β)g + βm), the "
    "server updates m ← (1 − β)·mean ∇f_i(x) + βm (Karimireddy et al. 2020a, Alg. 1).",
    "the FedDuA paper (§5: SGDm with momentum 0.9, following the Mime paper)",
    low=0.0,
    high=1.0,
    high_open=True,
)

#: prefixes of the arrays sent to the clients: m, and Mime's c
MOMENTUM, CORRECTION = "m/", "c/"


class MimeLite(LocalUpdate):
    """MimeLite with SGDm for any strategy: ``local_update=MimeLite(beta=0.9)``.

    Sends the server momentum m (once it has one); each client sends back
    its full-batch gradient ∇f_i(x), one array per trainable parameter.

    Parameters
    ----------
    beta : float (default: 0.9)
        β ∈ [0, 1) of SGDm (the FedDuA paper's §5, after the Mime paper).
        β = 0 is plain local SGD.
    """

    name: ClassVar[str] = "mimelite"
    client_module: ClassVar[str | None] = "fedadapt.client.mime"
    paper: ClassVar[Paper | None] = Paper(
        "Karimireddy et al. 2020",
        "Karimireddy et al., *Mime: Mimicking Centralized Stochastic Algorithms "
        "in Federated Learning*, arXiv:2008.03606 (Algorithm 1)",
    )
    params: ClassVar[tuple[Param, ...]] = (BETA,)
    #: local steps apply the server's SGDm through the gradient: plain SGD only
    client_optimizers: ClassVar[tuple[str, ...] | None] = ("sgd",)
    #: whether the clients also get c (Mime's SVRG correction)
    corrected: ClassVar[bool] = False

    def __init__(self, beta: float = float(BETA.default)) -> None:
        self.beta = float(BETA.check(beta))
        self.m: dict[str, NDArray[np.float64]] | None = None
        self.c: dict[str, NDArray[np.float64]] | None = None
        self._model: dict[str, tuple[int, ...]] = {}
        self._names: set[str] | None = None

    def configure(
        self, server_round: int, model: Mapping[str, NDArray[Any]], num_nodes: int
    ) -> tuple[dict[str, Scalar], Arrays]:
        """Send β, m and (Mime) c, each in the dtype of its model array."""
        self._model = {k: np.shape(v) for k, v in model.items()}
        self._names = None if self.m is None else set(self.m)
        arrays: Arrays = {}
        for prefix, state in ((MOMENTUM, self.m), (CORRECTION, self.c)):
            for name, value in (state or {}).items():
                dtype = np.asarray(model[name]).dtype if name in model else None
                arrays[prefix + name] = value.astype(dtype or value.dtype)
        return {self.key(BETA): self.beta}, arrays

    def check_reply(
        self, arrays: Mapping[str, NDArray[Any]] | None, metrics: Mapping[str, Any]
    ) -> str | None:
        """Refuse a reply without one finite ∇f_i(x) per trainable array.

        The names must be model arrays of matching shape and, within a round,
        the same for every reply (those of m once it exists).
        """
        if not arrays:
            return "expected the full-batch gradient ∇f_i(x), one array per parameter"
        for name, grad in arrays.items():
            if np.shape(grad) != self._model.get(name):
                return f"gradient {name!r} matches no model array of its shape"
            if not np.issubdtype(np.asarray(grad).dtype, np.floating):
                return f"gradient {name!r} is not a floating-point array"
            if not np.all(np.isfinite(grad)):
                return f"gradient {name!r} is not finite"
        if self._names is None:
            self._names = set(arrays)
        elif set(arrays) != self._names:
            return "gradient names differ from the other replies' (or from m's)"
        return None

    def aggregate(
        self,
        replies: Sequence[Mapping[str, NDArray[Any]] | None],
        weights: Sequence[float],
    ) -> dict[str, float]:
        """Update m ← (1 − β)·g + β·m, g = Σ w_i ∇f_i(x) / Σ w_i; Mime: c ← g.

        In float64 (the arrays sent are cast to the model's dtype).
        """
        used = [(r, w) for r, w in zip(replies, weights, strict=True) if r]
        if not used:
            return {}
        total = float(sum(w for _, w in used))
        mean: dict[str, NDArray[np.float64]] = {}
        for name in used[0][0]:
            acc = np.zeros(np.shape(used[0][0][name]), np.float64)
            for reply, weight in used:
                acc += weight * np.asarray(reply[name], np.float64)
            mean[name] = acc / total
        old = self.m or {}
        self.m = {
            name: (1.0 - self.beta) * g + self.beta * old.get(name, np.zeros_like(g))
            for name, g in mean.items()
        }
        if self.corrected:
            self.c = mean
        return {
            f"{self.name}-grad-norm": _norm(mean),
            f"{self.name}-momentum-norm": _norm(self.m),
        }

    def aggregate_mean(
        self, mean: Mapping[str, NDArray[Any]], num_replies: int
    ) -> dict[str, float]:
        """Update m ← (1 − β)·ḡ + β·m from SecAgg+'s mean of the ∇f_i(x).

        :meth:`aggregate` of the one mean: ḡ is weighted as the rule weights
        the models (uniform: the Mime paper's Algorithm 1, c = (1/|S|)
        Σ∇f_i; num-examples: what the plain mode uses). The gradients travel
        as they are (within ±c, step 2c/Q).
        """
        problem = self.check_reply(mean, {})
        if problem is not None:
            raise ValueError(problem)
        return self.aggregate([mean], [1.0])

    def _state(self) -> dict[str, Any]:
        return {"m": self.m, "c": self.c}

    def _load(self, state: dict[str, Any]) -> None:
        self.m, self.c = state["m"], state["c"]


class Mime(MimeLite):
    """Mime with SGDm for any strategy: ``local_update=Mime(beta=0.9)``.

    MimeLite plus SVRG's correction: clients also get c, the previous
    round's mean full-batch gradient (see the module docstring).

    Parameters
    ----------
    beta : float (default: 0.9)
        β ∈ [0, 1) of SGDm (the FedDuA paper's §5, after the Mime paper).
    """

    name: ClassVar[str] = "mime"
    corrected: ClassVar[bool] = True


LOCAL_UPDATES.register("mime")(Mime)
LOCAL_UPDATES.register("mimelite")(MimeLite)


def _norm(arrays: Mapping[str, NDArray[Any]]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(a))) for a in arrays.values())))
