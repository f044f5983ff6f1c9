r"""Δ-SGD, the locality-adaptive client optimizer, in ``torch.optim``'s shape.

Kim, Toghani, Uribe & Kyrillidis, "Adaptive Federated Learning with
Auto-Tuned Clients", ICLR 2024, arXiv:2306.11201. Each client runs SGD with a
step size set from its own local smoothness estimate. Algorithm 1 of
arXiv:2306.11201 extends eq. (4) there, the rule of Malitsky & Mishchenko,
"Adaptive Gradient Descent without Descent" (ICML 2020, arXiv:1910.09529,
Algorithm 1), to stochastic gradients and local steps; Appendix B.1 adds the
growth factor δ that the experiments use::

    η_0 = η0,  θ_0 = θ0  at the start of every round                   (line 6)
    x_k = x_{k-1} - η_{k-1} g̃(x_{k-1})                                  (line 8)
    η_k = min{ γ‖x_k - x_{k-1}‖ / (2‖g̃(x_k) - g̃(x_{k-1})‖),
               sqrt(1 + δ θ_{k-1}) η_{k-1} }                 (line 9, App. B.1)
    θ_k = η_k / η_{k-1}                                                (line 10)

Layout, as in ``torch.optim.SGD`` and ``torch.optim.Adam``: :class:`DeltaSGD`
handles parameter groups, state, the closure and validation, and its
``step()`` calls the functional :func:`delta_sgd` once per group. The
functional is :func:`delta_sgd_norms` (on the device), :func:`step_size` (the
whole rule, on host floats) and the update; the device work comes in two
implementations with the same values: ``_single_tensor_delta_sgd`` (one
operation per tensor) and ``_multi_tensor_delta_sgd`` (``torch._foreach_*``).
Design notes: docs/algorithms.md, "Δ-SGD: design notes".

Δ-SGD needs nothing from the server and keeps no state across rounds: call
:meth:`DeltaSGD.reset` (or build a new optimizer) at the start of each round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.optim.optimizer import ParamsT

from fedadapt._validation import check_choice, check_scalar
from fedadapt.optimizers._eager import EagerOptimizer
from fedadapt.optimizers._foreach import _check_foreach, _default_foreach

__all__ = [
    "DeltaSGD",
    "StepInfo",
    "delta_sgd",
    "delta_sgd_norms",
    "preserve_buffers",
    "step_size",
]

MODES = ("same_batch", "consecutive")
FIRST_STEPS = ("paper", "official")
#: Presets selected by ``compat``; explicit arguments override them.
COMPAT_PRESETS: dict[str, dict[str, Any]] = {
    # The official code (github.com/jlylekim/auto-tuned-FL, ``adsgd.py``) takes
    # its first step through the zero-norm guard and adds ``--lr_eps 1e-8`` to
    # the step size.
    "auto-tuned-FL": {"first_step": "official", "step_eps": 1e-8},
}

Closure = Callable[[], Any]


class StepInfo(NamedTuple):
    """What set the step size of one local step (for logging).

    Attributes
    ----------
    step : int
        Local step index ``k`` within the round (0 = first step).
    eta : float
        Step size ``η_k`` used to move the parameters at this step.
    theta : float
        ``θ_k = η_k / η_{k-1}`` after this step.
    branch : str
        ``"first"`` (k = 0), ``"smoothness"`` (first term of the min) or
        ``"growth"`` (second term, or a zero ``‖Δx‖``/``‖Δg‖``).
    smooth_term : float
        ``γ‖Δx‖ / (2‖Δg‖)``, the inverse local-smoothness estimate; ``inf``
        when a norm is zero, ``nan`` at the first step (not computed).
    """

    step: int
    eta: float
    theta: float
    branch: str
    smooth_term: float


class _BufferSnapshot:
    """Saves and restores every buffer of a module with a few foreach copies.

    The buffer list is collected once and re-collected only when a buffer
    was re-assigned (``module.x = tensor``); the snapshot tensors are
    allocated once and reused. Buffers are copied with one
    ``torch._foreach_copy_`` per (device, dtype) bucket, in place, so their
    identity (and any reference held elsewhere) is kept.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._owners: list[tuple[nn.Module, str, torch.Tensor]] | None = None
        self._live: list[list[torch.Tensor]] = []
        self._saved: list[list[torch.Tensor]] = []

    def _refresh(self) -> None:
        owners, seen = [], set()
        for mod in self.module.modules():
            for name, buf in mod._buffers.items():
                if buf is None or id(buf) in seen:
                    continue
                seen.add(id(buf))
                owners.append((mod, name, buf))
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for _, _, buf in owners:
            buckets.setdefault((buf.device, buf.dtype), []).append(buf)
        self._owners = owners
        self._live = list(buckets.values())
        self._saved = [[torch.empty_like(b) for b in live] for live in self._live]

    def save(self) -> None:
        """Snapshot the current values of every buffer."""
        if self._owners is None or not all(
            mod._buffers.get(name) is buf for mod, name, buf in self._owners
        ):
            self._refresh()
        with torch.no_grad():
            for saved, live in zip(self._saved, self._live, strict=True):
                torch._foreach_copy_(saved, live)

    def restore(self) -> None:
        """Copy the snapshot back into the buffers, in place."""
        with torch.no_grad():
            for live, saved in zip(self._live, self._saved, strict=True):
                torch._foreach_copy_(live, saved)

    @contextmanager
    def preserved(self) -> Iterator[None]:
        self.save()
        try:
            yield
        finally:
            self.restore()


@contextmanager
def preserve_buffers(module: nn.Module | None) -> Iterator[None]:
    """Restore every buffer of ``module`` on exit (BatchNorm statistics etc.).

    Snapshots ``module.buffers()`` (``running_mean``, ``running_var``,
    ``num_batches_tracked``, ...) on entry and copies the snapshot back in
    place on exit, also when the body raises. ``None`` is a no-op.

    :class:`DeltaSGD` wraps its extra ``same_batch`` pass in the same
    snapshot when given ``module=`` (keeping the buffer list and the snapshot
    tensors from step to step); custom training loops can use this for any
    forward pass that must not count towards the running statistics.

    Parameters
    ----------
    module : torch.nn.Module or None
        The module whose buffers (and its submodules') are restored.

    Yields
    ------
    None
        Inside the block the buffers change freely.
    """
    if module is None:
        yield
        return
    with _BufferSnapshot(module).preserved():
        yield


# ------------------------------------------------------------ step-size rule


def step_size(
    norms: Sequence[float],
    *,
    step: int,
    lr: float,
    theta: float,
    gamma: float,
    delta: float,
    first_step: str = "paper",
    step_eps: float = 0.0,
) -> StepInfo:
    r"""Return ``η_k`` and ``θ_k`` of local step ``k`` (the Δ-SGD rule).

    arXiv:2306.11201, Algorithm 1 lines 6, 9 and 10, with the δ of its
    Appendix B.1::

        k = 0:  η_0 = η0,  θ_0 = θ0                                   (line 6)
        k ≥ 1:  η_k = min{ γ‖Δx‖ / (2‖Δg‖), sqrt(1 + δ θ_{k-1}) η_{k-1} } + ε
                θ_k = η_k / η_{k-1}                                (lines 9-10)

    with ``Δx = x_k - x_{k-1}`` and ``Δg = g̃(x_k) - g̃(x_{k-1})``.

    Two guards and two variants of the official code
    (github.com/jlylekim/auto-tuned-FL, ``adsgd.py``):

    * A zero ``‖Δx‖`` or ``‖Δg‖`` (e.g. after reaching a minimiser, or on a
      linear loss) makes the first term ``0/0`` or ``+∞``; it is taken as
      ``+∞``, so the growth term sets ``η_k`` and finite inputs never give
      NaN weights (the official code does the same).
    * Non-finite norms raise before anything moves.
    * ``first_step="official"``: the official code starts each round with the
      previous iterate equal to the current one, so ``‖Δx‖ = 0`` and the
      guard above sets ``η_0 = sqrt(1 + δ θ0) η0``, ``θ_0 = sqrt(1 + δ θ0)``
      instead of line 6.
    * ``step_eps``: the official code adds its ``--lr_eps`` to the step size
      whenever the min is taken (not to the denominator, and not on the
      guard's branch).

    Parameters
    ----------
    norms : sequence of float
        ``(‖g̃(x_0)‖,)`` at ``step == 0`` (only checked to be finite), else
        ``(‖Δx‖, ‖Δg‖)``: global L2 norms over every tensor of the group.
    step : int
        Local step index ``k`` within the round.
    lr : float
        ``η_{k-1}``; at ``step == 0`` the round's initial step size ``η0``.
    theta : float
        ``θ_{k-1}``; at ``step == 0`` the initial ratio ``θ0``.
    gamma : float
        Amplifier ``γ > 0`` of the first term (line 9).
    delta : float
        Growth factor ``δ ≥ 0`` of the second term (Appendix B.1).
    first_step : {"paper", "official"}, default "paper"
        Step size of ``step == 0``: line 6, or the official code's.
    step_eps : float, default 0.0
        Added to ``η_k`` whenever the min is taken.

    Returns
    -------
    StepInfo
        ``η_k``, ``θ_k``, which term set ``η_k`` and the first term.

    Raises
    ------
    FloatingPointError
        A norm is NaN or infinite (a gradient or parameter is).
    """
    _check_norms(norms, step=step)
    growth = math.sqrt(1.0 + delta * theta)  # sqrt(1 + δ θ_{k-1})
    if step == 0:
        if first_step == "paper":  # line 6
            return StepInfo(0, lr, theta, "first", math.nan)
        return StepInfo(0, lr * growth, growth, "first", math.nan)
    dx, dg = norms
    grown = growth * lr  # sqrt(1 + δ θ_{k-1}) η_{k-1}
    if dx > 0.0 and dg > 0.0:
        smooth = gamma * dx / (2.0 * dg)  # γ‖Δx‖ / (2‖Δg‖)
        branch = "smoothness" if smooth < grown else "growth"
        eta = min(smooth, grown) + step_eps  # line 9
    else:  # the first term is 0/0 or +inf: take +inf
        smooth, branch, eta = math.inf, "growth", grown
    return StepInfo(step, eta, eta / lr, branch, smooth)  # line 10


def _check_norms(norms: Sequence[float], *, step: int) -> None:
    """Raise unless the norms of local step ``step`` are finite.

    Parameters
    ----------
    norms : sequence of float
        ``(‖g̃(x_0)‖,)`` at ``step == 0``, else ``(‖Δx‖, ‖Δg‖)``.
    step : int
        Local step index ``k`` within the round.

    Raises
    ------
    FloatingPointError
        A norm is NaN or infinite (a gradient or parameter is).
    """
    if step == 0:
        (g_norm,) = norms
        if not math.isfinite(g_norm):
            raise FloatingPointError(
                f"DeltaSGD: non-finite gradient at local step 0 (‖g‖={g_norm})"
            )
        return
    dx, dg = norms
    if not (math.isfinite(dx) and math.isfinite(dg)):
        raise FloatingPointError(
            f"DeltaSGD: non-finite norm at local step {step} (‖Δx‖={dx}, "
            f"‖Δg‖={dg}): a gradient or parameter is NaN/Inf"
        )


# ------------------------------------------------------------ device kernels


def _combine_norms(norms: Sequence[Tensor], parts: int) -> Tensor:
    """Global L2 norms of ``parts`` equal consecutive slices of per-tensor norms.

    The norm of a concatenation is the norm of its pieces' norms, so
    ``parts=2`` on the norms of ``dx + dg`` gives ``(‖Δx‖, ‖Δg‖)`` and
    splitting a tensor does not change them. Combined in float64 (float32 on
    MPS, which lacks float64) on the first norm's device; returns a 1-d tensor
    of ``parts`` values without synchronising with the host.
    """
    device = norms[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    try:
        stacked = torch.stack(list(norms))
    except RuntimeError:  # parameters on several devices
        stacked = torch.stack([n.to(device) for n in norms])
    # ``dtype`` casts every per-tensor norm before the reduction (exact).
    out: Tensor = torch.linalg.vector_norm(stacked.view(parts, -1), dim=1, dtype=dtype)
    return out


def _single_tensor_norms(
    params: list[Tensor],
    grads: list[Tensor],
    prev_params: Sequence[Tensor] | None,
    prev_grads: Sequence[Tensor] | None,
    *,
    step: int,
    weight_decay: float,
) -> Tensor:
    if step == 0:
        return _combine_norms([torch.linalg.vector_norm(g) for g in grads], 1)
    assert prev_params is not None and prev_grads is not None
    dxs = [p - q for p, q in zip(params, prev_params, strict=True)]
    dgs = [g - h for g, h in zip(grads, prev_grads, strict=True)]
    if weight_decay != 0.0:
        for dg, dx in zip(dgs, dxs, strict=True):
            dg.add_(dx, alpha=weight_decay)
    return _combine_norms([torch.linalg.vector_norm(t) for t in dxs + dgs], 2)


def _multi_tensor_norms(
    params: list[Tensor],
    grads: list[Tensor],
    prev_params: Sequence[Tensor] | None,
    prev_grads: Sequence[Tensor] | None,
    *,
    step: int,
    weight_decay: float,
) -> Tensor:
    if step == 0:
        return _combine_norms(torch._foreach_norm(grads), 1)
    assert prev_params is not None and prev_grads is not None
    n = len(params)
    diffs = torch._foreach_sub(params + grads, [*prev_params, *prev_grads])
    if weight_decay != 0.0:
        torch._foreach_add_(diffs[n:], diffs[:n], alpha=weight_decay)
    return _combine_norms(torch._foreach_norm(diffs), 2)


def _single_tensor_update(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    eta: float,
    weight_decay: float,
    keep_params: Sequence[Tensor] | None,
    keep_grads: Sequence[Tensor] | None,
) -> None:
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        if keep_params is not None:
            keep_params[i].copy_(param)
        if keep_grads is not None:
            keep_grads[i].copy_(grad)
        direction = grad
        if weight_decay != 0.0:
            direction = torch.add(grad, param, alpha=weight_decay)
        param.add_(direction, alpha=-eta)


def _multi_tensor_update(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    eta: float,
    weight_decay: float,
    keep_params: Sequence[Tensor] | None,
    keep_grads: Sequence[Tensor] | None,
) -> None:
    if keep_params is not None and keep_grads is not None:
        torch._foreach_copy_([*keep_params, *keep_grads], params + grads)
    elif keep_params is not None:
        torch._foreach_copy_(list(keep_params), params)
    elif keep_grads is not None:
        torch._foreach_copy_(list(keep_grads), grads)
    direction = grads
    if weight_decay != 0.0:
        direction = list(torch._foreach_add(grads, params, alpha=weight_decay))
    torch._foreach_add_(params, direction, alpha=-eta)


class _Norms(Protocol):
    def __call__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        prev_params: Sequence[Tensor] | None,
        prev_grads: Sequence[Tensor] | None,
        *,
        step: int,
        weight_decay: float,
    ) -> Tensor: ...


class _Update(Protocol):
    def __call__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        *,
        eta: float,
        weight_decay: float,
        keep_params: Sequence[Tensor] | None,
        keep_grads: Sequence[Tensor] | None,
    ) -> None: ...


class _Kernels(NamedTuple):
    """The device work of one step of one group, around the host decision.

    ``norms(params, grads, prev_params, prev_grads, *, step, weight_decay)``
    returns, on the device, ``(‖g̃(x_0)‖,)`` at step 0, else
    ``(‖Δx‖, ‖Δg‖)`` with ``Δg = g̃(x_k) - g̃(x_{k-1}) + λΔx`` (the
    difference of the weight-decayed directions ``g + λx``).

    ``update(params, grads, *, eta, weight_decay, keep_params, keep_grads)``
    first copies ``x_k`` into ``keep_params`` and ``g̃(x_k)`` into
    ``keep_grads`` (each skipped when ``None``), then moves
    ``x ← x - η (g + λx)`` (Algorithm 1 line 8; torch's coupled weight decay).
    """

    norms: _Norms
    update: _Update


_single_tensor_delta_sgd = _Kernels(_single_tensor_norms, _single_tensor_update)
_multi_tensor_delta_sgd = _Kernels(_multi_tensor_norms, _multi_tensor_update)


def _kernels(foreach: bool | None, params: Sequence[Tensor]) -> _Kernels:
    if foreach is None:
        foreach = _default_foreach(params)
    return _multi_tensor_delta_sgd if foreach else _single_tensor_delta_sgd


def delta_sgd_norms(
    params: list[Tensor],
    grads: list[Tensor],
    prev_params: Sequence[Tensor] | None,
    prev_grads: Sequence[Tensor] | None,
    *,
    step: int,
    weight_decay: float = 0.0,
    foreach: bool | None = None,
) -> Tensor:
    r"""Return the norms that set one group's step size, on the device (no sync).

    The first half of :func:`delta_sgd`: ``(‖g̃(x_0)‖,)`` at step 0, else
    ``(‖Δx‖, ‖Δg‖)`` with ``Δx = x_k - x_{k-1}`` and
    ``Δg = g̃(x_k) - g̃(x_{k-1}) + λΔx`` (arXiv:2306.11201, Algorithm 1 line 9;
    global L2 norms over every tensor, combined in float64). Callers that step
    several groups read all their norms back at once and pass each group's to
    :func:`delta_sgd` as ``norms``, as :meth:`DeltaSGD.step` does.

    Parameters
    ----------
    params, grads, prev_params, prev_grads : list of Tensor
        As in :func:`delta_sgd` (``prev_*`` unused at step 0).
    step : int
        Local step index ``k``.
    weight_decay : float, default 0.0
        Coupled L2 weight decay λ.
    foreach : bool or None, default None
        As in :func:`delta_sgd`.

    Returns
    -------
    Tensor
        A 1-d tensor of one or two norms on the first parameter's device.
    """
    return _kernels(foreach, params).norms(
        params, grads, prev_params, prev_grads, step=step, weight_decay=weight_decay
    )


def _to_host(norms: Sequence[Tensor]) -> list[list[float]]:
    """Read several groups' norms back with one host synchronisation."""
    if len(norms) == 1:
        return [norms[0].tolist()]
    device = norms[0].device
    flat: list[float] = torch.cat([n.to(device) for n in norms]).tolist()
    out, pos = [], 0
    for n in norms:
        out.append(flat[pos : pos + n.numel()])
        pos += n.numel()
    return out


def delta_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    prev_params: Sequence[Tensor] | None,
    prev_grads: Sequence[Tensor] | None,
    *,
    step: int,
    lr: float,
    theta: float,
    gamma: float = 2.0,
    delta: float = 0.1,
    first_step: str = "paper",
    step_eps: float = 0.0,
    weight_decay: float = 0.0,
    foreach: bool | None = None,
    norms: Sequence[float] | None = None,
) -> StepInfo:
    r"""Take one Δ-SGD step of one parameter group in place; return its step size.

    Functional form of :class:`DeltaSGD`, whose ``step()`` calls it once per
    group (arXiv:2306.11201, Algorithm 1 lines 8-10)::

        norms = delta_sgd_norms(...)   on the device, unless ``norms`` is given
        η_k, θ_k = step_size(norms)     on the host: one sync
        prev_params ← x_k,  prev_grads ← g̃(x_k)
        x_{k+1} = x_k - η_k (g̃(x_k) + λ x_k)

    Parameters
    ----------
    params, grads : list of Tensor
        The group's parameters ``x_k`` with a gradient (updated in place) and
        their gradients ``g̃(x_k)``.
    prev_params, prev_grads : list of Tensor or None
        ``x_{k-1}`` and ``g̃(x_{k-1})``, aligned with ``params``: the stored
        gradient of the previous step (consecutive mode) or the gradient at
        ``x_{k-1}`` on the current batch (same-batch mode). Read from step 1
        on unless ``norms`` is given; overwritten with ``x_k`` and ``g̃(x_k)``
        at every step, so that in consecutive mode they are the next step's
        inputs. ``None``: not kept (only with ``norms`` or at step 0).
    step : int
        Local step index ``k`` (0 at the start of a round).
    lr, theta : float
        ``η_{k-1}`` and ``θ_{k-1}``; at step 0, ``η0`` and ``θ0``.
    gamma, delta, first_step, step_eps : optional
        As in :func:`step_size`.
    weight_decay : float, default 0.0
        Coupled L2 weight decay λ (see :class:`DeltaSGD`).
    foreach : bool or None, default None
        ``True``: the ``torch._foreach_*`` implementation; ``False``: one
        operation per tensor; ``None``: foreach on CUDA and for small CPU
        tensors (the policy shared with Fed-LAMB,
        ``fedadapt.optimizers._foreach._default_foreach``). Same values.
    norms : sequence of float, optional
        This group's :func:`delta_sgd_norms`, already read back to the host;
        ``None`` computes them here (one host synchronisation).

    Returns
    -------
    StepInfo
        ``η_k`` (used for this step), ``θ_k`` and which term set ``η_k``:
        the next step's ``lr`` and ``theta``.

    Raises
    ------
    FloatingPointError
        Non-finite gradient, parameter difference or norm; nothing is changed.
    """
    kernels = _kernels(foreach, params)
    if norms is None:
        if step > 0 and (prev_params is None or prev_grads is None):
            raise ValueError(
                "delta_sgd: prev_params and prev_grads are needed from step 1 on "
                "(or pass this step's norms)"
            )
        norms = kernels.norms(
            params, grads, prev_params, prev_grads, step=step, weight_decay=weight_decay
        ).tolist()
    info = step_size(
        norms,
        step=step,
        lr=lr,
        theta=theta,
        gamma=gamma,
        delta=delta,
        first_step=first_step,
        step_eps=step_eps,
    )
    kernels.update(
        params,
        grads,
        eta=info.eta,
        weight_decay=weight_decay,
        keep_params=prev_params,
        keep_grads=prev_grads,
    )
    return info


# ------------------------------------------------------------ optimizer


class _GroupBuffers:
    """One group's round buffers, reused from step to step.

    ``params`` are the parameters that stepped at the previous step (those
    with a gradient), ``states`` their ``self.state`` dicts, ``prev`` their
    ``state["prev_param"]`` (x_{k-1}) and ``prev_grad`` their
    ``state["prev_grad"]`` (g_{k-1}, consecutive mode, else ``None``): the
    same tensor objects as in the optimizer state. ``spare`` (same_batch) is
    scratch space for x_k during the extra pass, not part of the state; after
    a step it swaps roles with ``prev``. ``default_foreach`` is
    ``_default_foreach(params)``, kept so that it is not recomputed every step.
    """

    __slots__ = (
        "default_foreach",
        "mode",
        "params",
        "prev",
        "prev_grad",
        "spare",
        "states",
    )

    def __init__(
        self,
        mode: str,
        params: list[Tensor],
        states: list[dict[str, Any]],
        prev: list[Tensor],
        prev_grad: list[Tensor] | None,
        default_foreach: bool,
    ) -> None:
        self.default_foreach = default_foreach
        self.mode = mode
        self.params = params
        self.states = states
        self.prev = prev
        self.prev_grad = prev_grad
        self.spare: list[Tensor] | None = None

    def matches(self, mode: str, params: list[Tensor]) -> bool:
        """Whether this step has the same mode and parameters with a gradient."""
        return (
            mode == self.mode
            and len(params) == len(self.params)
            and all(p is q for p, q in zip(params, self.params, strict=True))
        )


class _Plan:
    """One group's work in one step."""

    __slots__ = (
        "buffers",
        "default_foreach",
        "foreach",
        "grads",
        "group",
        "index",
        "olds",
        "params",
        "spare_holds_x",
    )

    def __init__(
        self,
        index: int,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        buffers: _GroupBuffers | None,
    ) -> None:
        self.index = index
        self.group = group
        self.params = params
        self.grads = grads
        self.buffers = buffers
        self.default_foreach = (
            _default_foreach(params) if buffers is None else buffers.default_foreach
        )
        foreach = group["foreach"]  # the group's option; None: the default
        self.foreach: bool = self.default_foreach if foreach is None else foreach
        self.olds: list[Tensor | None] | None = None  # same_batch g(x_{k-1})
        self.spare_holds_x = False  # buffers.spare holds x_k (extra pass ran)


class DeltaSGD(EagerOptimizer):
    r"""Δ-SGD client optimizer (arXiv:2306.11201, Algorithm 1 with δ).

    Per step ``k`` of a round (Algorithm 1 lines 8-10, with the amplifier γ
    of line 9 and the δ of Appendix B.1; see :func:`step_size`)::

        η_k = min{ γ‖x_k - x_{k-1}‖ / (2‖g̃(x_k) - g̃(x_{k-1})‖),
                   sqrt(1 + δ θ_{k-1}) η_{k-1} } + step_eps
        θ_k = η_k / η_{k-1}
        x_{k+1} = x_k - η_k g̃(x_k)

    One η per parameter group, from global norms over the group.
    :meth:`step` gathers each group's lists and calls :func:`delta_sgd`.
    Design notes (modes, closure contract, BatchNorm, cost, choices):
    docs/algorithms.md, "Δ-SGD: design notes".

    Parameters
    ----------
    params : iterable
        Parameters or parameter-group dicts; every option below except
        ``compat`` and ``module`` can be set per group.
    lr : float, default 0.2
        Initial step size η0 (arXiv:2306.11201 §3.1 footnote), kept in
        ``group["eta0"]``; ``group["lr"]`` holds the current ``η_{k-1}``.
    gamma : float, default 2.0
        Amplifier γ > 0 (Algorithm 1 line 9).
    delta : float, default 0.1
        Growth factor δ ≥ 0 (Appendix B.1, Table 1).
    theta0 : float, default 1.0
        Initial ratio θ0 ≥ 0 (Algorithm 1 line 6).
    mode : {"same_batch", "consecutive"}, default "same_batch"
        ``g̃(x_{k-1})`` on the current batch (two passes per step, needs
        ``step(closure)``; the paper's experiments) or the previous batch's
        stored gradient (one pass).
    first_step : {"paper", "official"}, optional
        Step size of the first step: line 6, or the official code's
        ``η0 sqrt(1 + δθ0)``. ``None``: the ``compat`` preset, else "paper".
    step_eps : float, optional
        Added to ``η_k`` whenever the min is taken (the official
        ``--lr_eps``). ``None``: the preset, else 0.
    weight_decay : float, default 0.0
        Coupled L2 weight decay λ ≥ 0 (our choice; the paper has none).
    compat : {None, "auto-tuned-FL"}, default None
        Preset of the official code: ``first_step="official"``,
        ``step_eps=1e-8``, unless given explicitly.
    module : torch.nn.Module, optional
        Keyword-only. Model whose buffers (BatchNorm statistics) the extra
        ``same_batch`` pass must not change (:func:`preserve_buffers`).
    foreach : bool or None, default None
        Keyword-only. Default of the group option ``foreach``: ``True`` the
        ``torch._foreach_*`` implementation, ``False`` one operation per
        tensor (same values), ``None`` foreach on CUDA and for small CPU
        tensors (the policy shared with Fed-LAMB). Not in ``defaults``.

    Attributes
    ----------
    history : list of list of StepInfo
        Per parameter group, one :class:`StepInfo` per local step of the
        current round; :meth:`reset` clears it. Not part of ``state_dict``.
    last_step_info : list of (StepInfo or None)
        Per group, the latest entry of ``history``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.2,
        gamma: float = 2.0,
        delta: float = 0.1,
        theta0: float = 1.0,
        mode: str = "same_batch",
        first_step: str | None = None,
        step_eps: float | None = None,
        weight_decay: float = 0.0,
        compat: str | None = None,
        *,
        module: nn.Module | None = None,
        foreach: bool | None = None,
    ) -> None:
        preset: dict[str, Any] = {}
        if compat is not None:
            check_choice("compat", compat, tuple(COMPAT_PRESETS))
            preset = COMPAT_PRESETS[compat]
        if first_step is None:
            first_step = preset.get("first_step", "paper")
        if step_eps is None:
            step_eps = preset.get("step_eps", 0.0)
        defaults = {
            "lr": lr,
            "gamma": gamma,
            "delta": delta,
            "theta0": theta0,
            "mode": mode,
            "first_step": first_step,
            "step_eps": step_eps,
            "weight_decay": weight_decay,
        }
        _validate_hyperparameters(defaults)
        self.compat = compat
        self.foreach = _check_foreach(foreach)  # the groups' default (not in defaults)
        self._module = module
        self._history: list[list[StepInfo]] = []
        # Per group index: this round's x_{k-1} / g_{k-1} buffers (not state).
        self._buffers: dict[int, _GroupBuffers] = {}
        self._snapshot: _BufferSnapshot | None = None
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; validates its hyperparameters and sets ``η0 = lr``."""
        for name, value in self.defaults.items():
            param_group.setdefault(name, value)
        param_group["foreach"] = _check_foreach(
            param_group.get("foreach", self.foreach)
        )
        _validate_hyperparameters(param_group)
        param_group["eta0"] = param_group["lr"]
        param_group["theta"] = param_group["theta0"]
        param_group["k"] = 0
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("compat", None)
        self.__dict__.setdefault("foreach", None)
        self.__dict__.setdefault("_module", None)
        self.__dict__.setdefault("_history", [])
        self.__dict__.setdefault("_snapshot", None)
        self._buffers = {}  # the state may have been replaced: rebuild lazily
        for group in self.param_groups:
            group.setdefault("eta0", group["lr"])
            group.setdefault("theta", group["theta0"])
            group.setdefault("k", 0)
            group.setdefault("foreach", self.foreach)

    def state_dict(self) -> dict[str, Any]:
        """Torch's ``state_dict``, with copies of the state tensors.

        The buffers ``prev_param`` / ``prev_grad`` are refreshed in place at
        every step, so the returned dict holds copies: it stays a snapshot of
        this step.

        Returns
        -------
        dict
            ``{"state": ..., "param_groups": ...}`` as in torch.
        """
        out = super().state_dict()
        out["state"] = {
            key: {
                name: value.clone() if isinstance(value, Tensor) else value
                for name, value in entry.items()
            }
            for key, entry in out["state"].items()
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's ``load_state_dict``; the state tensors are copied.

        The loaded ``prev_param`` / ``prev_grad`` become this optimizer's
        buffers, which are refreshed in place, so they never share memory
        with ``state_dict``.

        Parameters
        ----------
        state_dict : dict
            As returned by :meth:`state_dict`.
        """
        super().load_state_dict(state_dict)
        for entry in self.state.values():
            for name, value in entry.items():
                if isinstance(value, Tensor):
                    entry[name] = value.clone()
        self._buffers = {}

    # ----------------------------------------------------------------- logging

    @property
    def history(self) -> list[list[StepInfo]]:
        """Per group, the :class:`StepInfo` of every step of this round."""
        while len(self._history) < len(self.param_groups):
            self._history.append([])
        return self._history

    @property
    def last_step_info(self) -> list[StepInfo | None]:
        """Per group, the latest :class:`StepInfo` (``None`` before a step)."""
        return [h[-1] if h else None for h in self.history]

    def stats(self, group: int = 0) -> dict[str, float]:
        """Summarise this round's step sizes of one group, for metrics.

        Before any step the η values equal the group's current ``lr`` and
        ``growth-fraction`` is 0.

        Parameters
        ----------
        group : int, default 0
            Index of the parameter group.

        Returns
        -------
        dict of str to float
            ``steps``, ``eta-last``, ``eta-mean``, ``eta-min``, ``eta-max`` and
            ``growth-fraction`` (share of steps k ≥ 1 set by the growth term).
        """
        hist = self.history[group]
        if not hist:
            lr = float(self.param_groups[group]["lr"])
            return {
                "steps": 0.0,
                "eta-last": lr,
                "eta-mean": lr,
                "eta-min": lr,
                "eta-max": lr,
                "growth-fraction": 0.0,
            }
        etas = [info.eta for info in hist]
        later = [info for info in hist if info.branch != "first"]
        growth = sum(info.branch == "growth" for info in later)
        return {
            "steps": float(len(etas)),
            "eta-last": etas[-1],
            "eta-mean": math.fsum(etas) / len(etas),
            "eta-min": min(etas),
            "eta-max": max(etas),
            "growth-fraction": growth / len(later) if later else 0.0,
        }

    # ------------------------------------------------------------------- round

    def reset(self, lr: float | None = None) -> None:
        """Start a new round: ``η ← η0``, ``θ ← θ0``, no previous iterate.

        Algorithm 1 line 6 (arXiv:2306.11201). Clears the per-parameter state
        and ``history``.

        Parameters
        ----------
        lr : float, optional
            First sets a new ``η0`` for every group, e.g. the round's client
            learning rate sent by the server.
        """
        if lr is not None:
            lr = check_scalar("lr", lr, low=0.0, low_inclusive=False)
        for group in self.param_groups:
            if lr is not None:
                group["eta0"] = lr
            group["lr"] = group["eta0"]
            group["theta"] = group["theta0"]
            group["k"] = 0
        self.state.clear()
        self._buffers = {}
        self._history = [[] for _ in self.param_groups]

    # -------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Any:
        """Take one Δ-SGD step; return the closure's loss at ``x_k`` (or None).

        Parameters
        ----------
        closure : callable, optional
            Zeroes the gradients, recomputes the loss on the current batch,
            calls ``backward()`` and returns the loss. Required in
            ``same_batch`` mode (see docs/algorithms.md); optional in
            ``consecutive`` mode.

        Returns
        -------
        Any
            What ``closure`` returned at ``x_k``, or ``None`` without one.

        Raises
        ------
        ValueError
            ``same_batch`` mode without a closure.
        FloatingPointError
            Non-finite gradient, parameter difference or norm; nothing is
            changed.
        """
        if closure is None and any(
            g["mode"] == "same_batch" for g in self.param_groups
        ):
            raise ValueError(
                "DeltaSGD(mode='same_batch') needs step(closure): the closure must "
                "zero the gradients, recompute the loss on the current batch, call "
                "backward() and return the loss; step() calls it a second time at "
                "the previous iterate x_{k-1} on the same batch. Use "
                "mode='consecutive' to step from existing .grad without a closure."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        plans = self._plans()
        # Same-batch: g̃_{B_k}(x_{k-1}) for every same_batch group with k ≥ 1.
        extra = [p for p in plans if p.group["mode"] == "same_batch" and p.group["k"]]
        if extra:
            assert closure is not None  # checked above
            self._grads_at_previous_iterate(closure, extra)
        if not plans:
            return loss
        # The norms of every group, read back in one host synchronisation and
        # checked before any group moves.
        norms = _to_host([self._norms(plan) for plan in plans])
        for plan, value in zip(plans, norms, strict=True):
            try:
                _check_norms(value, step=plan.group["k"])
            except FloatingPointError as err:
                raise FloatingPointError(
                    f"{err} (param group {plan.index}); parameters and state left "
                    "unchanged"
                ) from None
        for plan, value in zip(plans, norms, strict=True):
            group, k = plan.group, plan.group["k"]
            keep_params, keep_grads = self._keep_buffers(plan)
            info = delta_sgd(
                plan.params,
                plan.grads,
                keep_params,
                keep_grads,
                step=k,
                lr=group["eta0"] if k == 0 else group["lr"],
                theta=group["theta0"] if k == 0 else group["theta"],
                gamma=group["gamma"],
                delta=group["delta"],
                first_step=group["first_step"],
                step_eps=group["step_eps"],
                weight_decay=group["weight_decay"],
                foreach=plan.foreach,
                norms=value,
            )
            group["lr"], group["theta"], group["k"] = info.eta, info.theta, k + 1
            self.history[plan.index].append(info)
        return loss

    def _norms(self, plan: _Plan) -> Tensor:
        """:func:`delta_sgd_norms` of one group, on the device."""
        k = plan.group["k"]
        prevs, olds = self._previous(plan) if k > 0 else (None, None)
        return delta_sgd_norms(
            plan.params,
            plan.grads,
            prevs,
            olds,
            step=k,
            weight_decay=plan.group["weight_decay"],
            foreach=plan.foreach,
        )

    def _plans(self) -> list[_Plan]:
        """Each group with a parameter that has a gradient at ``x_k``."""
        plans = []
        for index, group in enumerate(self.param_groups):
            params: list[Tensor] = []
            grads: list[Tensor] = []
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    if grad.is_sparse:
                        raise RuntimeError("DeltaSGD does not support sparse gradients")
                    params.append(p)
                    grads.append(grad)
            if not params:
                continue
            buffers = self._buffers.get(index)
            if buffers is not None and not buffers.matches(group["mode"], params):
                buffers = None  # the parameters with a gradient changed
            plans.append(_Plan(index, group, params, grads, buffers))
        return plans

    def _previous(self, plan: _Plan) -> tuple[list[Tensor], list[Tensor]]:
        """``x_{k-1}`` and ``g̃(x_{k-1})`` aligned with ``plan.params``.

        A parameter without stored ``x_{k-1}`` did not move at the previous
        step (``x_{k-1} = x_k``); a missing previous gradient counts as zero.
        """
        params, grads, buffers = plan.params, plan.grads, plan.buffers
        if buffers is not None:
            prevs = buffers.prev
        else:
            states = [self.state.get(p, {}) for p in params]
            prevs = [
                s.get("prev_param", p) for s, p in zip(states, params, strict=True)
            ]
        if plan.group["mode"] == "same_batch":
            assert plan.olds is not None  # set by the extra pass
            olds = plan.olds
        elif buffers is not None and buffers.prev_grad is not None:
            return prevs, buffers.prev_grad
        else:
            olds = [self.state.get(p, {}).get("prev_grad") for p in params]
        return prevs, [
            torch.zeros_like(g) if h is None else h
            for g, h in zip(grads, olds, strict=True)
        ]

    def _keep_buffers(
        self, plan: _Plan
    ) -> tuple[list[Tensor] | None, list[Tensor] | None]:
        """Where this step keeps ``x_k`` (and ``g_k`` in consecutive mode).

        Reuses the round's buffers, or in same_batch swaps them with the spare
        that already holds ``x_k`` (then nothing is left to copy: ``(None,
        None)``). Otherwise (first step of a round, a change in the parameters
        with a gradient, a loaded state): drops the state of parameters
        without a gradient (they do not move: ``x_{k-1} = x_k``) and
        (re)allocates.
        """
        group, params, grads = plan.group, plan.params, plan.grads
        buffers = plan.buffers
        if buffers is None:
            with_grad = set(params)
            for p in group["params"]:
                if p not in with_grad:
                    self.state.pop(p, None)
            states = [self.state[p] for p in params]
            prev = [
                _buffer(s, "prev_param", p) for s, p in zip(states, params, strict=True)
            ]
            prev_grad = None
            if group["mode"] == "consecutive":
                prev_grad = [
                    _buffer(s, "prev_grad", g)
                    for s, g in zip(states, grads, strict=True)
                ]
            else:
                for s in states:
                    s.pop("prev_grad", None)
            buffers = _GroupBuffers(
                group["mode"], params, states, prev, prev_grad, plan.default_foreach
            )
            self._buffers[plan.index] = buffers
        elif plan.spare_holds_x:
            assert buffers.spare is not None
            buffers.prev, buffers.spare = buffers.spare, buffers.prev
            for s, t in zip(buffers.states, buffers.prev, strict=True):
                s["prev_param"] = t
            return None, None
        return buffers.prev, buffers.prev_grad

    def _grads_at_previous_iterate(self, closure: Closure, plans: list[_Plan]) -> None:
        """Run the closure once at ``x_{k-1}`` (same_batch mode).

        Saves ``x_k``, sets every parameter of the plans' groups that moved at
        the previous step to its stored ``x_{k-1}``, detaches all gradients
        of the optimizer (so the closure's ``zero_grad`` cannot touch
        ``g̃(x_k)``), runs the closure with the module's buffers preserved,
        and restores ``x_k`` and the gradients, also on error. Sets
        ``plan.olds`` to the new gradients of ``plan.params``.
        """
        swap: list[Tensor] = []
        prevs: list[Tensor] = []
        saves: list[Tensor] = []
        for plan in plans:
            buffers = plan.buffers
            if buffers is not None:
                if buffers.spare is None:
                    buffers.spare = [torch.empty_like(p) for p in buffers.params]
                swap += buffers.params
                prevs += buffers.prev
                saves += buffers.spare
                plan.spare_holds_x = True
                continue
            for p in plan.group["params"]:
                state = self.state.get(p, {})
                if "prev_param" in state:
                    swap.append(p)
                    prevs.append(state["prev_param"])
                    saves.append(torch.empty_like(p))
        all_params = [p for group in self.param_groups for p in group["params"]]
        saved_grads = [p.grad for p in all_params]
        if swap:
            torch._foreach_copy_(saves, swap)
        for p in all_params:
            p.grad = None
        try:
            if swap:
                torch._foreach_copy_(swap, prevs)
            guard: AbstractContextManager[None] = nullcontext()
            if self._module is not None:
                if self._snapshot is None or self._snapshot.module is not self._module:
                    self._snapshot = _BufferSnapshot(self._module)
                guard = self._snapshot.preserved()
            with torch.enable_grad(), guard:
                closure()
            for plan in plans:
                plan.olds = [p.grad for p in plan.params]
        finally:
            if swap:
                torch._foreach_copy_(swap, saves)
            for p, g in zip(all_params, saved_grads, strict=True):
                p.grad = g


def _buffer(state: dict[str, Any], key: str, like: Tensor) -> Tensor:
    """``state[key]`` if it can hold a copy of ``like``, else a new buffer."""
    buf = state.get(key)
    if (
        buf is None
        or buf.shape != like.shape
        or buf.dtype != like.dtype
        or buf.device != like.device
    ):
        buf = torch.empty_like(like, memory_format=torch.preserve_format)
        state[key] = buf
    return buf


def _validate_hyperparameters(group: dict[str, Any]) -> None:
    """Validate (and convert to float) one group's hyperparameters in place."""
    group["lr"] = check_scalar("lr", group["lr"], low=0.0, low_inclusive=False)
    group["gamma"] = check_scalar("gamma", group["gamma"], low=0.0, low_inclusive=False)
    group["delta"] = check_scalar("delta", group["delta"], low=0.0)
    group["theta0"] = check_scalar("theta0", group["theta0"], low=0.0)
    group["step_eps"] = check_scalar("step_eps", group["step_eps"], low=0.0)
    group["weight_decay"] = check_scalar("weight_decay", group["weight_decay"], low=0.0)
    check_choice("mode", group["mode"], MODES)
    check_choice("first_step", group["first_step"], FIRST_STEPS)
