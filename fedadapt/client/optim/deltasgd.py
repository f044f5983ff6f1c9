r"""Δ-SGD: distributed locality-adaptive SGD as a client optimizer.

Kim, Kim, Park and Kyrillidis, "Adaptive federated learning with
auto-tuned clients" (ICLR 2024; arXiv and short workshop versions). Each
client runs SGD with a step size set from its own local smoothness estimate
(ICLR Algorithm 1, lines 8-10, extending Malitsky & Mishchenko's eq. (4))::

    x_k   = x_{k-1} - η_{k-1} g̃(x_{k-1})                                 (line 8)
    η_k   = min{ γ‖x_k - x_{k-1}‖ / (2‖g̃(x_k) - g̃(x_{k-1})‖),
                 sqrt(1 + δ θ_{k-1}) η_{k-1} }                          (line 9)
    θ_k   = η_k / η_{k-1}                                               (line 10)
    η_0 = η0, θ_0 = θ0 at the start of every round                      (line 6)

Normative description: ``algorithms-spec.md`` §2 and ambiguity index §9.1
(A-D1 ... A-D24). Δ-SGD needs nothing from the server and keeps no state
across rounds: call :meth:`DeltaSGD.reset` (or build a new optimizer) at the
start of each round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.optim.optimizer import Optimizer, ParamsT

from fedadapt._validation import check_choice, check_scalar

__all__ = ["DeltaSGD", "StepInfo", "preserve_buffers"]

MODES = ("same_batch", "consecutive")
FIRST_STEPS = ("paper", "official")
#: Presets selected by ``compat``; explicit arguments override them.
COMPAT_PRESETS: dict[str, dict[str, Any]] = {
    # [C] auto-tuned-FL ``adsgd.py``: first step through the zero-norm guard
    # (spec §2.7) and ``--lr_eps 1e-8`` added to the step size (spec §2.6).
    "auto-tuned-FL": {"first_step": "official", "step_eps": 1e-8},
}

Closure = Callable[[], Any]


class StepInfo(NamedTuple):
    """What set the step size of one local step (for logging, spec §2.9).

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
    """
    if module is None:
        yield
        return
    with _BufferSnapshot(module).preserved():
        yield


def _global_norms(tensors: list[torch.Tensor], parts: int = 1) -> torch.Tensor:
    """Euclidean norms of ``parts`` equal consecutive slices of ``tensors``.

    Spec §2.4: the norm of the concatenation of each slice (``parts=2``
    gives ``‖Δx‖`` and ``‖Δg‖`` from ``dx + dg``). Per-tensor norms come from
    one ``torch._foreach_norm`` call and are combined in float64 (float32 on
    MPS, which lacks float64) on the first tensor's device; returns a 1-d
    tensor of ``parts`` values. Nothing is synchronised with the host here.
    """
    device = tensors[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    norms = torch._foreach_norm(tensors)
    try:
        stacked = torch.stack(norms)
    except RuntimeError:  # parameters on several devices
        stacked = torch.stack([n.to(device) for n in norms])
    # ``dtype`` casts every per-tensor norm before the reduction (exact).
    return torch.linalg.vector_norm(stacked.view(parts, -1), dim=1, dtype=dtype)


class _GroupBuffers:
    """One group's round buffers, reused from step to step (spec §2.4).

    ``params`` are the parameters that stepped at the previous step (those
    with a gradient), ``states`` their ``self.state`` dicts, ``prev`` their
    ``state["prev_param"]`` (x_{k-1}) and ``prev_grad`` their
    ``state["prev_grad"]`` (g_{k-1}, consecutive mode, else ``None``): the
    same tensor objects as in the optimizer state. ``spare`` (same_batch) is
    scratch space for x_k during the extra pass, not part of the state; after
    a step it swaps roles with ``prev``.
    """

    __slots__ = ("mode", "params", "prev", "prev_grad", "spare", "states")

    def __init__(
        self,
        mode: str,
        params: list[torch.Tensor],
        states: list[dict[str, Any]],
        prev: list[torch.Tensor],
        prev_grad: list[torch.Tensor] | None,
    ) -> None:
        self.mode = mode
        self.params = params
        self.states = states
        self.prev = prev
        self.prev_grad = prev_grad
        self.spare: list[torch.Tensor] | None = None

    def matches(self, mode: str, params: list[torch.Tensor]) -> bool:
        """Whether this step has the same mode and parameters with a gradient."""
        return (
            mode == self.mode
            and len(params) == len(self.params)
            and all(p is q for p, q in zip(params, self.params, strict=True))
        )


class _Plan:
    """One group's work in one step."""

    __slots__ = ("buffers", "grads", "group", "olds", "params", "spare_holds_x")

    def __init__(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        buffers: _GroupBuffers | None,
    ) -> None:
        self.group = group
        self.params = params
        self.grads = grads
        self.buffers = buffers
        self.olds: list[torch.Tensor | None] | None = None  # same_batch g(x_{k-1})
        self.spare_holds_x = False  # buffers.spare holds x_k (extra pass ran)


class DeltaSGD(Optimizer):
    r"""Δ-SGD client optimizer (ICLR 2024 Algorithm 1 with δ, spec §2.1).

    Per step ``k`` of a round (ICLR Alg. 1 lines 8-10; eq. (4) with the
    amplifier γ and the δ of ICLR §4 / App. B.1)::

        η_k = min{ γ‖x_k - x_{k-1}‖ / (2‖g̃(x_k) - g̃(x_{k-1})‖),
                   sqrt(1 + δ θ_{k-1}) η_{k-1} } + step_eps
        θ_k = η_k / η_{k-1}
        x_{k+1} = x_k - η_k g̃(x_k)

    One η per parameter group; both norms are global L2 norms over all
    parameters of the group that have a gradient (spec §2.4), so splitting a
    tensor does not change the step sizes.

    Parameters
    ----------
    params : iterable
        Parameters or parameter-group dicts. Every hyperparameter below can be
        overridden per group.
    lr : float, default 0.2
        Initial step size ``η0`` (ICLR fn. 3). It is kept in
        ``param_groups[i]["eta0"]``; ``param_groups[i]["lr"]`` holds the
        *current* adaptive step size ``η_{k-1}`` (torch convention, so LR
        loggers see it).
    gamma : float, default 2.0
        The paper's "amplifier" γ > 0 of the first term (ICLR fn. 2-3, A-D4).
        The official code's ``damping`` equals ``2/γ`` (spec §2.2, A-D3).
    delta : float, default 0.1
        Growth factor δ ≥ 0 of the second term (ICLR §4, App. B.1; A-D2).
        The official code calls it ``amplifier``.
    theta0 : float, default 1.0
        Initial ratio θ0 ≥ 0 (ICLR fn. 3; A-D5). Must be finite.
    mode : {"same_batch", "consecutive"}, default "same_batch"
        Which gradient ``g̃(x_{k-1})`` is compared with (spec §2.5, A-D9).
        ``"same_batch"`` (official code): recompute the gradient at the
        previous iterate on the *current* batch; costs **two forward/backward
        passes per step** and requires ``closure``; keeps two parameter-sized
        buffers (``x_{k-1}`` and a spare that receives ``x_k``).
        ``"consecutive"``: reuse the stored gradient of the previous step
        (previous batch); one pass; keeps ``x_{k-1}`` and ``g_{k-1}``.
    first_step : {"paper", "official"}, optional
        ``"paper"`` (default, Alg. 1): the first step uses ``η0``.
        ``"official"``: the code's zero-norm guard fires at the first step,
        so it uses ``η0 sqrt(1 + δθ0)`` and sets ``θ = sqrt(1 + δθ0)``
        (spec §2.7, A-D7). ``None`` takes the ``compat`` preset, else paper.
    step_eps : float, optional
        Added to the step size (not to a denominator) whenever the min is
        taken (spec §2.6, A-D8). ``None`` takes the preset, else 0.
    weight_decay : float, default 0.0
        Coupled L2 weight decay λ ≥ 0 (torch SGD style): the update direction
        is ``g + λx`` and ``‖Δg‖`` is taken of that direction,
        ``‖(g_k - g_{k-1}) + λ(x_k - x_{k-1})‖``, i.e. the smoothness of the
        regularised objective. The official client uses 0 (spec §2.2), so
        this choice never affects a reproduction.
    compat : {None, "auto-tuned-FL"}, default None
        Preset: ``"auto-tuned-FL"`` sets ``first_step="official"`` and
        ``step_eps=1e-8`` unless they are given explicitly.
    module : torch.nn.Module, optional
        Keyword-only. The model whose buffers (BatchNorm running statistics)
        must not be changed by the extra ``same_batch`` pass: they are
        snapshot before and restored after it (:func:`preserve_buffers`),
        matching the official code, which discards ``prev_net``'s statistics.
        Without it the closure is responsible for that.

    Attributes
    ----------
    history : list of list of StepInfo
        Per parameter group, one :class:`StepInfo` per local step of the
        current round; :meth:`reset` clears it. Not part of ``state_dict``.
    last_step_info : list of (StepInfo or None)
        Per group, the latest entry of ``history``.

    Notes
    -----
    **Closure contract** (like :class:`torch.optim.LBFGS`): ``closure`` must
    zero the gradients, recompute the loss on the current batch, call
    ``backward()`` and return the loss::

        def closure():
            optimizer.zero_grad()
            loss = criterion(model(inputs), targets)
            loss.backward()
            return loss

        loss = optimizer.step(closure)

    In ``same_batch`` mode, from the second step of a round on, ``step``
    calls the closure twice: once at ``x_k`` (its loss is returned and its
    gradients are used for the update) and once with the parameters of *all*
    ``same_batch`` groups temporarily set to ``x_{k-1}``. Afterwards ``x_k``
    and the gradients ``g̃(x_k)`` are restored. The closure must therefore
    use the same batch on every call (it normally captures it) and must not
    step anything else; both passes run in whatever train/eval mode the
    model is in, so dropout masks differ (as in the official code). The first
    step of a round needs a single pass (its step size does not depend on a
    gradient difference). Gradient scaling with ``torch.amp.GradScaler`` is
    not supported in this mode (the scaler does not accept closures).

    In ``consecutive`` mode ``closure`` is optional; with ``None`` the
    existing ``.grad`` is used, as in SGD.

    Zero ``‖Δx‖`` or ``‖Δg‖`` selects the growth term (spec §2.6), so finite
    inputs never give NaN weights. Non-finite gradients or norms raise
    :class:`FloatingPointError` before anything is changed: the parameters
    stay at ``x_k`` with their gradients, and the optimizer state is intact.

    One host synchronisation per step (the scalar norms for the min); all
    tensor arithmetic uses ``torch._foreach_*`` kernels, so a step issues a
    fixed number of operations whatever the number of tensors (7 in
    ``consecutive`` mode, 13 plus the closure calls in ``same_batch`` mode
    with a ``module`` holding buffers of two dtypes, for one parameter group
    without weight decay). ``x_{k-1}`` and
    ``g_{k-1}`` live in buffers allocated at the first step of a round and
    refreshed in place (``state[p]["prev_param"]``, ``["prev_grad"]``);
    :meth:`state_dict` therefore returns copies of them and
    :meth:`load_state_dict` copies what it loads.

    Deviations from the spec: none in the arithmetic. ``first_step`` and
    ``step_eps`` default to ``None`` (resolved as documented) so that an
    explicit value can override the ``compat`` preset. With
    ``first_step="official"`` the extra pass of the first step is skipped,
    because the code's ``‖Δx‖ = 0`` already forces the growth branch.
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
        _validate_hyperparameters(param_group)
        param_group["eta0"] = param_group["lr"]
        param_group["theta"] = param_group["theta0"]
        param_group["k"] = 0
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("compat", None)
        self.__dict__.setdefault("_module", None)
        self.__dict__.setdefault("_history", [])
        self.__dict__.setdefault("_snapshot", None)
        self._buffers = {}  # the state may have been replaced: rebuild lazily
        for group in self.param_groups:
            group.setdefault("eta0", group["lr"])
            group.setdefault("theta", group["theta0"])
            group.setdefault("k", 0)

    def state_dict(self) -> dict[str, Any]:
        """Torch's ``state_dict``, with copies of the state tensors.

        The buffers ``prev_param`` / ``prev_grad`` are refreshed in place at
        every step, so the returned dict holds copies: it stays a snapshot of
        this step.
        """
        out = super().state_dict()
        out["state"] = {
            key: {
                name: value.clone() if isinstance(value, torch.Tensor) else value
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
        """
        super().load_state_dict(state_dict)
        for entry in self.state.values():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
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
        """Summary of this round's step sizes for one group, for metrics.

        Returns ``steps``, ``eta-last``, ``eta-mean``, ``eta-min``,
        ``eta-max`` and ``growth-fraction`` (share of steps k ≥ 1 set by the
        growth term) as floats. Before any step the η values equal the
        group's current ``lr`` and ``growth-fraction`` is 0.
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

        ICLR Alg. 1 line 6 (spec §2.3). Clears the per-parameter state and
        ``history``. ``lr`` (optional) first sets a new ``η0`` for every
        group, e.g. the round's client learning rate sent by the server.
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
    def step(self, closure: Closure | None = None) -> Any:  # type: ignore[override]
        """Take one Δ-SGD step; return the closure's loss at ``x_k`` (or None).

        Parameters
        ----------
        closure : callable, optional
            Zeroes the gradients, recomputes the loss on the current batch,
            calls ``backward()`` and returns the loss. Required in
            ``same_batch`` mode (see the class notes); optional in
            ``consecutive`` mode.

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

        # Parameters with a gradient at x_k, per group (spec §2.4).
        plans: list[_Plan] = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError("DeltaSGD does not support sparse gradients")
            buffers = self._buffers.get(index)
            if buffers is not None and not buffers.matches(group["mode"], params):
                buffers = None  # the parameters with a gradient changed
            plans.append(_Plan(group, params, grads, buffers))

        # Same-batch: g̃_{B_k}(x_{k-1}) for every same_batch group with k ≥ 1.
        extra = [
            plan
            for plan in plans
            if plan.params
            and plan.group["mode"] == "same_batch"
            and plan.group["k"] > 0
        ]
        if extra:
            assert closure is not None  # checked above
            self._grads_at_previous_iterate(closure, extra)

        # Norms (device tensors) for every group, then one host sync.
        checks: list[torch.Tensor] = []
        for plan in plans:
            group, params, grads = plan.group, plan.params, plan.grads
            if not params:
                continue
            if group["k"] == 0:
                checks.append(_global_norms(grads))
                continue
            prevs, olds = self._previous(plan)
            n = len(params)
            diffs = torch._foreach_sub(params + grads, prevs + olds)  # dx + dg
            if group["weight_decay"] != 0.0:
                torch._foreach_add_(diffs[n:], diffs[:n], alpha=group["weight_decay"])
            checks.append(_global_norms(diffs, parts=2))
        if not checks:
            return loss
        if len(checks) == 1:
            values = checks[0].tolist()
        else:
            device = checks[0].device
            values = torch.cat([c.to(device) for c in checks]).tolist()

        # Step sizes for every group; raise before changing anything.
        decisions: list[StepInfo | None] = []
        pos = 0
        for index, plan in enumerate(plans):
            group = plan.group
            if not plan.params:
                decisions.append(None)
                continue
            if group["k"] == 0:
                (gnorm,) = values[pos : pos + 1]
                pos += 1
                if not math.isfinite(gnorm):
                    raise FloatingPointError(
                        f"DeltaSGD: non-finite gradient at local step 0 (param group "
                        f"{index}, ‖g‖={gnorm}); parameters and state left unchanged"
                    )
                decisions.append(_first_step(group))
            else:
                a, b = values[pos : pos + 2]
                pos += 2
                if not (math.isfinite(a) and math.isfinite(b)):
                    raise FloatingPointError(
                        f"DeltaSGD: non-finite norm at local step {group['k']} (param "
                        f"group {index}, ‖Δx‖={a}, ‖Δg‖={b}): a gradient or parameter "
                        "is NaN/Inf; parameters and state left unchanged"
                    )
                decisions.append(_adaptive_step(group, a, b))

        # Apply: store x_k (and g_k in consecutive mode), then x ← x - η(g + λx).
        for index, (plan, info) in enumerate(zip(plans, decisions, strict=True)):
            if info is None:
                continue
            group, params, grads = plan.group, plan.params, plan.grads
            self._store_previous(index, plan)
            direction = grads
            if group["weight_decay"] != 0.0:
                direction = torch._foreach_add(
                    grads, params, alpha=group["weight_decay"]
                )
            torch._foreach_add_(params, direction, alpha=-info.eta)
            group["lr"] = info.eta
            group["theta"] = info.theta
            group["k"] += 1
            self.history[index].append(info)
        return loss

    def _previous(self, plan: _Plan) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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
            olds = plan.olds
        elif buffers is not None and buffers.prev_grad is not None:
            return prevs, buffers.prev_grad
        else:
            olds = [self.state.get(p, {}).get("prev_grad") for p in params]
        assert olds is not None
        olds = [
            torch.zeros_like(g) if h is None else h
            for g, h in zip(grads, olds, strict=True)
        ]
        return prevs, olds

    def _store_previous(self, index: int, plan: _Plan) -> None:
        """Keep ``x_k`` (and ``g_k`` in consecutive mode) for the next step.

        Reuses the round's buffers (one ``torch._foreach_copy_``, or in
        same_batch a swap with the spare that already holds ``x_k``).
        Otherwise (first step of a round, a change in the parameters with a
        gradient, a loaded state): drops the state of parameters without a
        gradient (they do not move: ``x_{k-1} = x_k``) and (re)allocates.
        """
        group, params, grads = plan.group, plan.params, plan.grads
        consecutive = group["mode"] == "consecutive"
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
            if consecutive:
                prev_grad = [
                    _buffer(s, "prev_grad", g)
                    for s, g in zip(states, grads, strict=True)
                ]
            else:
                for s in states:
                    s.pop("prev_grad", None)
            buffers = _GroupBuffers(group["mode"], params, states, prev, prev_grad)
            self._buffers[index] = buffers
        elif plan.spare_holds_x:
            assert buffers.spare is not None
            buffers.prev, buffers.spare = buffers.spare, buffers.prev
            for s, t in zip(buffers.states, buffers.prev, strict=True):
                s["prev_param"] = t
            return
        if buffers.prev_grad is not None:
            torch._foreach_copy_(buffers.prev + buffers.prev_grad, params + grads)
        else:
            torch._foreach_copy_(buffers.prev, params)

    def _grads_at_previous_iterate(self, closure: Closure, plans: list[_Plan]) -> None:
        """Run the closure once at ``x_{k-1}`` (spec §2.5, same_batch).

        Saves ``x_k``, sets every parameter of the plans' groups that moved at
        the previous step to its stored ``x_{k-1}``, detaches all gradients
        of the optimizer (so the closure's ``zero_grad`` cannot touch
        ``g̃(x_k)``), runs the closure with the module's buffers preserved,
        and restores ``x_k`` and the gradients, also on error. Sets
        ``plan.olds`` to the new gradients of ``plan.params``.
        """
        swap: list[torch.Tensor] = []
        prevs: list[torch.Tensor] = []
        saves: list[torch.Tensor] = []
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
            guard = nullcontext()
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


def _buffer(state: dict[str, Any], key: str, like: torch.Tensor) -> torch.Tensor:
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


def _first_step(group: dict[str, Any]) -> StepInfo:
    """Step size of local step 0 (spec §2.7): η0, or the code's growth step."""
    eta0, theta0 = group["eta0"], group["theta0"]
    if group["first_step"] == "paper":  # Alg. 1 line 6: η_{t,0} = η0, θ_{t,0} = θ0
        return StepInfo(0, eta0, theta0, "first", math.nan)
    # [C] prev_net == model at the first batch: ‖Δx‖ = 0, the guard fires.
    growth = math.sqrt(1.0 + group["delta"] * theta0)
    return StepInfo(0, eta0 * growth, growth, "first", math.nan)


def _adaptive_step(group: dict[str, Any], a: float, b: float) -> StepInfo:
    """ICLR Alg. 1 lines 9-10 with δ and the zero-norm guard (spec §2.6).

    ``a = ‖x_k - x_{k-1}‖``, ``b = ‖g̃(x_k) - g̃(x_{k-1})‖``.
    """
    eta_prev, theta_prev = group["lr"], group["theta"]
    growth = math.sqrt(1.0 + group["delta"] * theta_prev) * eta_prev
    if a > 0.0 and b > 0.0:
        smooth = group["gamma"] * a / (2.0 * b)
        branch = "smoothness" if smooth < growth else "growth"
        eta = min(smooth, growth) + group["step_eps"]
    else:  # treat the first term as +inf
        smooth = math.inf
        branch = "growth"
        eta = growth
    return StepInfo(group["k"], eta, eta / eta_prev, branch, smooth)


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
