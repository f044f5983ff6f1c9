"""Server-side aggregation of Fed-LAMB / Fed-AMS second moments (NumPy only).

LAMB Alg. 1 lines 13–16 as fixed by algorithms-spec §3.3: clients send their
raw second moments v_i (line 13), and the server keeps

    v̂_r = max(v̂_{r−1}, Σ_{i∈D^r} ω_i v_i)     (elementwise, line 16)

with uniform ω over the participants D^r by default (A-L6), v̂_0 = ε·1
(line 2; A-L11), and the state after round r used in round r+1 (A-L7).
v̂ is therefore monotone non-decreasing; the strategy must checkpoint it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from fedadapt._validation import check_scalar

__all__ = ["aggregate_second_moments"]


def _check_array(where: str, value: object) -> NDArray[np.floating]:
    """Return ``value`` as a floating array, or raise if not finite and >= 0."""
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{where} has dtype {array.dtype}, expected a float dtype")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{where} has non-finite values (NaN or inf)")
    if np.any(array < 0):
        raise ValueError(f"{where} has negative values; second moments are >= 0")
    return array


def _check_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """Return normalised weights ω (sum 1); uniform when ``weights`` is None."""
    if weights is None:
        return [1.0 / n] * n
    weights = list(weights)
    if len(weights) != n:
        raise ValueError(f"Invalid weights: got {len(weights)} for {n} clients")
    checked = [check_scalar(f"weights[{i}]", w, low=0.0) for i, w in enumerate(weights)]
    total = math.fsum(checked)
    if total <= 0.0:
        raise ValueError(f"Invalid weights: {weights} (sum must be > 0)")
    return [w / total for w in checked]


def aggregate_second_moments(
    v_hat_prev: Mapping[str, NDArray[np.floating]] | None,
    client_v: Sequence[Mapping[str, NDArray[np.floating]]],
    weights: Sequence[float] | None = None,
    eps: float = 1e-8,
) -> dict[str, NDArray[np.floating]]:
    """Return v̂_r = max(v̂_{r−1}, Σ_i ω_i v_i), elementwise, per array name.

    LAMB Alg. 1 lines 13–16 (spec §3.3): the participants' raw second moments
    are averaged and the result never drops below the previous v̂, so v̂ is
    non-decreasing over rounds. The mean is taken in float64 and the result
    cast back to the inputs' dtype (which keeps the max monotone, since
    v̂_{r−1} is exactly representable). Inputs are not modified.

    Parameters
    ----------
    v_hat_prev : dict of str to ndarray, or None
        v̂_{r−1}, keyed like the model's arrays. ``None`` (round 1) uses
        v̂_0 = ε·1 (LAMB Alg. 1 line 2).
    client_v : list of dict of str to ndarray
        The raw v of each participating client (LAMB Alg. 1 line 13), all
        with the same names, shapes and float dtype; finite and >= 0.
    weights : sequence of float or None, optional
        Client weights (e.g. num-examples), >= 0 with a positive sum; they are
        normalised to sum to 1. ``None``: uniform over the participants, as
        printed in LAMB Alg. 1 line 15 (A-L6). Defaults to None.
    eps : float, optional
        ε of v̂_0 = ε·1, >= 0 (A-L11). Only used when ``v_hat_prev`` is None.
        Defaults to 1e-8.

    Returns
    -------
    dict of str to ndarray
        v̂_r, with the names (in the first client's order), shapes and dtype
        of the inputs.

    Raises
    ------
    ValueError
        No clients; names, shapes or dtypes that differ between clients or
        from ``v_hat_prev`` (no broadcasting, no silent casts); non-float,
        non-finite or negative values; bad ``weights`` or ``eps``.
    """
    eps = check_scalar("eps", eps, low=0.0)
    if len(client_v) == 0:
        raise ValueError("client_v is empty: need at least one client's v")
    omega = _check_weights(weights, len(client_v))
    names = list(client_v[0])
    reference = {
        name: _check_array(f"client_v[0][{name!r}]", array)
        for name, array in client_v[0].items()
    }
    clients = [reference]
    for i, v in enumerate(client_v[1:], start=1):
        if set(v) != set(names):
            raise ValueError(
                f"client_v[{i}] has array names {sorted(v)}, expected {sorted(names)}"
            )
        clients.append({n: _check_array(f"client_v[{i}][{n!r}]", v[n]) for n in names})
    prev: dict[str, NDArray[np.floating]] | None = None
    if v_hat_prev is not None:
        if set(v_hat_prev) != set(names):
            raise ValueError(
                f"v_hat_prev has array names {sorted(v_hat_prev)}, expected "
                f"{sorted(names)}"
            )
        prev = {n: _check_array(f"v_hat_prev[{n!r}]", v_hat_prev[n]) for n in names}
    others = [(f"client_v[{i}]", c) for i, c in enumerate(clients)]
    if prev is not None:
        others.append(("v_hat_prev", prev))
    for name in names:
        ref = reference[name]
        for where, arrays in others:
            got = arrays[name]
            if got.shape != ref.shape:
                raise ValueError(
                    f"{where}[{name!r}] has shape {got.shape}, expected {ref.shape} "
                    "(no broadcasting)"
                )
            if got.dtype != ref.dtype:
                raise ValueError(
                    f"{where}[{name!r}] has dtype {got.dtype}, expected {ref.dtype}"
                )

    result: dict[str, NDArray[np.floating]] = {}
    for name in names:
        ref = reference[name]
        mean = np.zeros(ref.shape, dtype=np.float64)
        for w, client in zip(omega, clients, strict=True):
            mean += w * client[name].astype(np.float64)
        floor = (
            np.full(ref.shape, eps, dtype=np.float64)
            if prev is None
            else prev[name].astype(np.float64)
        )
        result[name] = np.maximum(floor, mean).astype(ref.dtype)
    return result
