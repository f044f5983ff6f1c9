"""FedDuA's synthetic over-parameterised linear regression (NumPy only).

Paper: "FedDuA: Doubly Adaptive Federated Learning" (Takakura et al.), §5.1
("Synthetic Datasets") and App. H.2. For each of
``M = 20`` clients, ``n = 30`` samples ``(x_j, y_j)`` with

    x_j ~ N(0, Σ),  Σ = diag(k^{-1.1}), k = 1..d (d = 1000),
    y_j = ⟨w_{i,j}, x_j⟩,  w_{i,j} ~ N(w_i, 1),  w_i ~ N(0, 0.1).

The paper leaves open whether there is one ``w_{i,j}`` per sample, whether
``N(0, 0.1)`` gives a variance or a standard deviation, whether ``w_i`` is a
scalar or a vector, any normalisation, and the loss; this module takes:

* one model ``w_{i,j}`` per *sample*, literally as written in the paper;
* ``w_i`` a *scalar* (broadcast over all d coordinates) with *standard
  deviation* 0.1 (the FedExP generator's convention), not a variance;
* no normalisation of inputs or labels;
* the loss ``F(w) = (1/M) Σ_i (1/(2n)) ‖X_i w − y_i‖²`` with ``w_0 = 0``.

Since ``d = 1000 > M·n = 600`` the problem interpolates: ``min F = 0``.

The random stream is fixed: ``rng = np.random.default_rng(seed)`` and, client
by client, ``w_i``, then ``X_i``, then ``W_ij`` are drawn, so a seed always
gives the same data. The module is pure (no torch, no Flower).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["linreg_grad", "linreg_loss", "make_feddua_linreg"]

#: Exponent β in Σ_kk = k^{-β} (FedDuA §5.1: β = 1.1).
COVARIANCE_DECAY = 1.1


def make_feddua_linreg(
    seed: int = 0,
    dim: int = 1000,
    num_clients: int = 20,
    samples_per_client: int = 30,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Generate FedDuA's synthetic linear-regression clients (App. H.2).

    The open choices are taken as listed in the module docstring.

    Parameters
    ----------
    seed : int (default: 0)
        Seed of ``np.random.default_rng``.
    dim : int (default: 1000)
        Input dimension d.
    num_clients : int (default: 20)
        Number of clients M.
    samples_per_client : int (default: 30)
        Samples per client n.

    Returns
    -------
    tuple[NDArray[np.float64], NDArray[np.float64]]
        ``X`` of shape ``(M, n, d)`` and ``y`` of shape ``(M, n)``.
    """
    for name, value in (
        ("dim", dim),
        ("num_clients", num_clients),
        ("samples_per_client", samples_per_client),
    ):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    d, m, n = int(dim), int(num_clients), int(samples_per_client)
    rng = np.random.default_rng(seed)
    sd = np.arange(1, d + 1, dtype=np.float64) ** (-COVARIANCE_DECAY / 2)
    xs = np.empty((m, n, d))
    ys = np.empty((m, n))
    for i in range(m):
        w_i = rng.normal(0.0, 0.1)  # scalar, std 0.1 (our reading)
        x_i = rng.normal(size=(n, d)) * sd  # x ~ N(0, Σ)
        w_ij = rng.normal(w_i, 1.0, size=(n, d))  # one model per sample
        xs[i] = x_i
        ys[i] = np.einsum("jk,jk->j", x_i, w_ij)
    return xs, ys


def _residuals(
    w: NDArray[Any], x: NDArray[np.float64], y: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Return ``X_i w − y_i`` for every client: shape ``(M, n)`` (or batched)."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim == 1:
        return np.einsum("mnd,d->mn", x, w) - y
    return np.einsum("mnd,...md->...mn", x, w) - y


def linreg_loss(
    w: NDArray[Any], x: NDArray[np.float64], y: NDArray[np.float64]
) -> float:
    """Return ``F(w) = (1/M) Σ_i (1/(2n)) ‖X_i w − y_i‖²`` (our reading of §5.1).

    Parameters
    ----------
    w : NDArray
        Model of shape ``(d,)``.
    x, y : NDArray[np.float64]
        Data from :func:`make_feddua_linreg`, shapes ``(M, n, d)``, ``(M, n)``.

    Returns
    -------
    float
        The mean over clients of the local losses.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.shape != x.shape[-1:]:
        raise ValueError(f"w must have shape {x.shape[-1:]}, got {w.shape}")
    r = _residuals(w, x, y)
    return float(np.mean(0.5 * np.mean(r**2, axis=-1)))


def linreg_grad(
    w: NDArray[Any], x: NDArray[np.float64], y: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Return every client's gradient ``∇f_i(w) = X_iᵀ(X_i w − y_i)/n``.

    Parameters
    ----------
    w : NDArray
        One model ``(d,)`` shared by all clients, or one model per client
        ``(M, d)`` (e.g. the clients' local iterates), or a batch ``(..., M, d)``.
    x, y : NDArray[np.float64]
        Data from :func:`make_feddua_linreg`, shapes ``(M, n, d)``, ``(M, n)``.

    Returns
    -------
    NDArray[np.float64]
        Gradients of shape ``(M, d)`` (or ``(..., M, d)``), where
        ``f_i(w) = (1/(2n)) ‖X_i w − y_i‖²``; their mean is ``∇F``.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.shape[-1:] != x.shape[-1:] or (w.ndim > 1 and w.shape[-2] != x.shape[0]):
        raise ValueError(
            f"w must have shape {x.shape[-1:]} or (..., {x.shape[0]}, {x.shape[-1]}),"
            f" got {w.shape}"
        )
    r = _residuals(w, x, y)
    return np.einsum("mnd,...mn->...md", x, r) / x.shape[1]
