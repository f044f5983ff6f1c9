r"""Fed-LAMB and Fed-AMS client optimizers (LAMB Algorithm 1).

Paper: Karimi, Li & Li, "Layer-wise and Dimension-wise Locally Adaptive
Federated Learning", UAI 2023, arXiv:2110.00532 (cited as LAMB; algorithm
line numbers as in its Algorithm 1).

Both are local AMSGrad with a second moment shared through the server. They
differ only in the final line of the local step: Fed-LAMB rescales each
parameter tensor by a trust ratio (LAMB Algorithm 1 line 12), Fed-AMS takes
the plain AMSGrad step (the Local AMSGrad baseline of LAMB §1 and §4, which
the paper does not write out). One kernel, :func:`fed_lamb`, implements both
through its ``trust_ratio`` flag.

Client step (LAMB Algorithm 1 lines 7-12, with the listing's gaps filled as
noted below)::

    round start:  m ← 0;  t ← 0;  v ← v̂_{r−1};  v̂_loc ← v̂_{r−1}
    each step:    t ← t + 1
                  m ← β1 m + (1−β1) g               m̂ ← m / (1−β1^t)  (optional)
                  v ← β2 v + (1−β2) g²              (raw EMA, never corrected)
                  v̂_loc ← max(v̂_loc, v)
                  den ← sqrt(v̂_loc) + ε    or  sqrt(v̂_loc / (1−β2^t)) + ε
                  p ← m̂ / den
    Fed-LAMB:     u ← p + λ θ;  r ← φ(‖θ‖) / ‖u‖  (1 if ‖θ‖ = 0 or ‖u‖ = 0)
                  θ ← θ − α r u                     (per parameter tensor)
    Fed-AMS:      θ ← θ − α p

Where the listing is incomplete or inconsistent we read it as follows. The
gradient is taken at the current iterate. ``v`` starts each round at the
server's v̂ and is the raw EMA. The listing uses v̂ in the step without
defining a local max, so the local AMSGrad max v̂_loc starts at the server's
v̂. ``m`` restarts at 0 every round (clients are stateless). Bias-correcting
a warm-started ``v`` would inflate the first denominators (up to 1000x at
t = 1 with β2 = 0.999) and make the server's v̂ grow geometrically, so only
``m`` is corrected by default; a torch-style correction of the denominator
alone is optional. A "layer" is one parameter tensor (weight and bias
separately).

State uses torch's Adam key names: ``step`` (t), ``exp_avg`` (m),
``exp_avg_sq`` (v) and ``max_exp_avg_sq`` (v̂_loc).

Round protocol. At the start of each round the client calls
:meth:`FedLAMB.load_second_moments` with the server's v̂_{r−1} (``None`` in
round 1 gives v̂_0 = ε·1, LAMB Algorithm 1 line 2); at the end it sends
:meth:`FedLAMB.second_moments`, the raw v of every parameter (LAMB Algorithm
1 line 13 and Fig. 1 both send v, not v̂). The server side is
:func:`fedadapt.strategies.core.aggregate_second_moments`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from fedadapt._validation import check_decay_rate, check_scalar
from fedadapt.optimizers._eager import EagerOptimizer
from fedadapt.optimizers._foreach import _check_foreach, _default_foreach

__all__ = ["FedAMS", "FedLAMB", "fed_lamb"]


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"Invalid {name}: {value!r} (expected a bool)")
    return value


def _check_betas(betas: Any) -> tuple[float, float]:
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair)")
    return (
        check_decay_rate("beta_1", betas[0]),
        check_decay_rate("beta_2", betas[1]),
    )


def _check_phi_bounds(bounds: Any) -> tuple[float, float] | None:
    """Validate ``(lo, hi)`` of φ(z) = clip(z, lo, hi): 0 <= lo <= hi, hi > 0."""
    if bounds is None:
        return None
    if not isinstance(bounds, tuple | list) or len(bounds) != 2:
        raise ValueError(f"Invalid phi_bounds: {bounds!r} (expected None or a pair)")
    lo = check_scalar("phi_bounds[0]", bounds[0], low=0.0)
    hi = check_scalar("phi_bounds[1]", bounds[1], low=0.0, low_inclusive=False)
    if lo > hi:
        raise ValueError(f"Invalid phi_bounds: {tuple(bounds)} (need lo <= hi)")
    return (lo, hi)


def _trust_ratios(
    w_norm: Tensor, u_norm: Tensor, phi_bounds: tuple[float, float] | None
) -> Tensor:
    """Return r = φ(‖θ‖)/‖u‖ elementwise, or 1 where either norm is zero.

    LAMB Algorithm 1 line 12 with a zero-norm guard: without it a
    zero-initialised tensor would never move (φ(0) = 0). φ is the identity
    (LAMB §4) or ``clamp(z, lo, hi)`` when ``phi_bounds`` is given (a bounded
    φ, as LAMB's analysis assumes). Works on 0-d tensors and on stacked norms
    alike, with no host sync.
    A NaN norm also gives 1 (``min`` propagates it and ``NaN > 0`` is false).
    """
    phi = w_norm if phi_bounds is None else w_norm.clamp(phi_bounds[0], phi_bounds[1])
    ok = torch.minimum(w_norm, u_norm) > 0
    return torch.where(ok, phi / u_norm, 1.0)


def fed_lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    trust_ratio: bool,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    bias_correction_m: bool = True,
    bias_correction_v: bool = False,
    phi_bounds: tuple[float, float] | None = None,
    foreach: bool | None = None,
) -> None:
    """Apply one Fed-LAMB (``trust_ratio=True``) or Fed-AMS step in place.

    Functional form of :class:`FedLAMB` / :class:`FedAMS` (LAMB Algorithm 1
    lines 7-12; see the module docstring).
    All lists are aligned per parameter; ``state_steps`` holds 0-d CPU tensors
    (t of the current round), incremented here.

    Parameters
    ----------
    params, grads : list of Tensor
        Parameters θ (updated in place) and their gradients g.
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs : list of Tensor
        m, the raw second moment v, and the local AMSGrad max v̂_loc.
    state_steps : list of Tensor
        Local step counters t (restart at 0 each round).
    trust_ratio : bool
        ``True``: Fed-LAMB layerwise step (LAMB Algorithm 1 line 12). ``False``:
        Fed-AMS step θ ← θ − α p; ``weight_decay`` and ``phi_bounds`` unused.
    lr, beta1, beta2, eps : float
        α, β1, β2, ε (LAMB Algorithm 1 line 1).
    weight_decay : float, optional
        λ of LAMB Algorithm 1 line 12 (Fed-LAMB only). Defaults to 0.0.
    bias_correction_m : bool, optional
        Divide m by 1−β1^t (LAMB Algorithm 1 line 8). Defaults to True.
    bias_correction_v : bool, optional
        Use sqrt(v̂_loc/(1−β2^t)) in the denominator only, never correcting v
        itself (see the module docstring). Defaults to False.
    phi_bounds : tuple of float or None, optional
        Clip bounds of φ; ``None`` is the identity. Defaults to None.
    foreach : bool or None, optional
        Use the ``torch._foreach_*`` path; ``None`` picks it when all tensors
        are on CUDA, or all on CPU with at most 32,768 elements per tensor on
        average (faster there; the policy shared with Δ-SGD,
        ``fedadapt.optimizers._foreach._default_foreach``). Both paths
        compute the same values. Defaults to None.
    """
    if foreach is None:
        foreach = _default_foreach(params)
    kernel = _foreach_fed_lamb if foreach else _single_tensor_fed_lamb
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        trust_ratio=trust_ratio,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        bias_correction_m=bias_correction_m,
        bias_correction_v=bias_correction_v,
        phi_bounds=phi_bounds,
    )


def _bias_corrections(
    step: float, beta1: float, beta2: float, correct_m: bool, correct_v: bool
) -> tuple[float, float]:
    """Return (1−β1^t or 1, sqrt(1−β2^t) or 1) for local step t."""
    bc1 = 1.0 - beta1**step if correct_m else 1.0
    bc2_sqrt = math.sqrt(1.0 - beta2**step) if correct_v else 1.0
    return bc1, bc2_sqrt


def _bucket_bias_corrections(
    steps: list[Tensor], beta1: float, beta2: float, correct_m: bool, correct_v: bool
) -> tuple[float | list[float], float | list[float]]:
    """:func:`_bias_corrections` for a bucket of step counters.

    Reads every t in one go (one ``stack``, no per-tensor ``.item()``) and
    returns plain floats when all t are equal (the usual case: every
    parameter had a gradient at every step), else one value per tensor.
    """
    if not (correct_m or correct_v):
        return 1.0, 1.0
    try:
        values = torch.stack(steps).tolist()
    except RuntimeError:  # counters on several devices
        values = [s.item() for s in steps]
    first = values[0]
    if all(v == first for v in values):
        return _bias_corrections(first, beta1, beta2, correct_m, correct_v)
    pairs = [_bias_corrections(v, beta1, beta2, correct_m, correct_v) for v in values]
    return [c[0] for c in pairs], [c[1] for c in pairs]


def _single_tensor_fed_lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    trust_ratio: bool,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction_m: bool,
    bias_correction_v: bool,
    phi_bounds: tuple[float, float] | None,
) -> None:
    for param, grad, m, v, v_max, step_t in zip(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, strict=True
    ):
        step_t.add_(1)
        bc1, bc2_sqrt = 1.0, 1.0
        if bias_correction_m or bias_correction_v:
            bc1, bc2_sqrt = _bias_corrections(
                step_t.item(), beta1, beta2, bias_correction_m, bias_correction_v
            )
        # LAMB Algorithm 1 lines 8-9: m and the raw EMA v.
        m.lerp_(grad, 1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        # Local AMSGrad max and denominator (module docstring); dividing by a
        # correction of 1 is skipped (it is exact).
        torch.maximum(v_max, v, out=v_max)
        den = v_max.sqrt()
        if bias_correction_v:
            den.div_(bc2_sqrt)
        den.add_(eps)
        if not trust_ratio:
            # Fed-AMS: θ ← θ − α m̂ / den.
            param.addcdiv_(m, den, value=-lr / bc1)
            continue
        # Fed-LAMB, LAMB Algorithm 1 line 12: u = p + λθ, θ ← θ − α r u.
        update = m.div(den)
        if bias_correction_m:
            update.div_(bc1)
        if weight_decay != 0.0:
            update.add_(param, alpha=weight_decay)
        ratio = _trust_ratios(
            torch.linalg.vector_norm(param),
            torch.linalg.vector_norm(update),
            phi_bounds,
        )
        param.add_(update.mul_(ratio), alpha=-lr)


def _foreach_fed_lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    trust_ratio: bool,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction_m: bool,
    bias_correction_v: bool,
    phi_bounds: tuple[float, float] | None,
) -> None:
    if not params:
        return
    # The fast kernels need one device and dtype per call: group the indices.
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault((p.device, p.dtype), []).append(i)
    for idx in buckets.values():
        p_ = [params[i] for i in idx]
        g_ = [grads[i] for i in idx]
        m_ = [exp_avgs[i] for i in idx]
        v_ = [exp_avg_sqs[i] for i in idx]
        vmax_ = [max_exp_avg_sqs[i] for i in idx]
        steps = [state_steps[i] for i in idx]

        torch._foreach_add_(steps, 1)
        bc1, bc2_sqrt = _bucket_bias_corrections(
            steps, beta1, beta2, bias_correction_m, bias_correction_v
        )

        torch._foreach_lerp_(m_, g_, 1.0 - beta1)
        torch._foreach_mul_(v_, beta2)
        torch._foreach_addcmul_(v_, g_, g_, value=1.0 - beta2)
        torch._foreach_maximum_(vmax_, v_)
        den = torch._foreach_sqrt(vmax_)
        if bias_correction_v:
            torch._foreach_div_(den, bc2_sqrt)
        torch._foreach_add_(den, eps)
        if not trust_ratio:
            if isinstance(bc1, list):
                torch._foreach_addcdiv_(p_, m_, den, [-lr / c for c in bc1])
            else:
                torch._foreach_addcdiv_(p_, m_, den, value=-lr / bc1)
            continue
        update = torch._foreach_div(m_, den)
        if bias_correction_m:
            torch._foreach_div_(update, bc1)
        if weight_decay != 0.0:
            torch._foreach_add_(update, p_, alpha=weight_decay)
        # ‖θ‖ and ‖u‖ of every tensor in one call, read back to the host once
        # (one sync on CUDA): r then costs no kernel launches, and as plain
        # numbers the factors keep _foreach_mul_ on its fused path (a list of
        # 0-d device tensors would broadcast: one kernel per tensor). The
        # elementwise float arithmetic of r is the same on every device.
        n = len(p_)
        norms = torch.stack(torch._foreach_norm([*p_, *update])).view(2, n).cpu()
        ratios = _trust_ratios(norms[0], norms[1], phi_bounds)
        torch._foreach_mul_(update, ratios.tolist())
        torch._foreach_add_(p_, update, alpha=-lr)


class _LocalAMSGrad(EagerOptimizer):
    """Shared optimizer class of Fed-LAMB and Fed-AMS (one kernel, one flag)."""

    _trust_ratio: bool = False

    def _fill_state(self, p: Tensor, v_hat: Tensor) -> None:
        """Start a round for ``p``: m = 0, t = 0, v = v̂_loc = v̂ (LAMB Algorithm 1)."""
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = v_hat.to(device=p.device, dtype=p.dtype).clone(
            memory_format=torch.preserve_format
        )
        state["max_exp_avg_sq"] = state["exp_avg_sq"].clone()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("foreach", None)
            group.setdefault("bias_correction_m", True)
            group.setdefault("bias_correction_v", False)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        max_exp_avg_sqs: list[Tensor],
        state_steps: list[Tensor],
    ) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients"
                )
            if torch.is_complex(p):
                raise RuntimeError(
                    f"{type(self).__name__} does not support complex parameters"
                )
            state = self.state[p]
            if len(state) == 0:
                # Never loaded: round 1 with v̂_0 = ε·1 (LAMB Algorithm 1 line 2).
                self._fill_state(p, torch.full_like(p, group["eps"]))
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            state_steps.append(state["step"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one local step (LAMB Algorithm 1 lines 7-12).

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model and returns the loss.

        Returns
        -------
        float or None
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            exp_avg_sqs: list[Tensor] = []
            max_exp_avg_sqs: list[Tensor] = []
            state_steps: list[Tensor] = []
            self._init_group(
                group,
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                state_steps,
            )
            beta1, beta2 = group["betas"]
            fed_lamb(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                state_steps,
                trust_ratio=self._trust_ratio,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group.get("weight_decay", 0.0),
                bias_correction_m=group["bias_correction_m"],
                bias_correction_v=group["bias_correction_v"],
                phi_bounds=group.get("phi_bounds"),
                foreach=group["foreach"],
            )
        return loss

    @torch.no_grad()
    def load_second_moments(self, v_hat: Sequence[Tensor] | None) -> None:
        """Start a new round from the server's v̂_{r−1} (LAMB Algorithm 1).

        Sets ``exp_avg_sq`` (v) and ``max_exp_avg_sq`` (v̂_loc) of every
        parameter to v̂_{r−1}, and resets ``exp_avg`` (m) to 0 and ``step`` (t)
        to 0 (LAMB Algorithm 1 lines 4-6). Values are copied and cast to each
        parameter's device and dtype. Inputs are validated before any state
        changes.

        Parameters
        ----------
        v_hat : sequence of Tensor or None
            One tensor (or array-like) per parameter, in parameter order (param
            groups in order, then each group's ``params``), shaped like the
            parameter, finite and >= 0. ``None`` gives v̂_0 = ε·1 with each
            group's ε (LAMB Algorithm 1 line 2).

        Raises
        ------
        ValueError
            Wrong count or shape, or non-finite or negative values.
        """
        params = self._params()
        if v_hat is None:
            values = [
                torch.full_like(p, group["eps"])
                for group in self.param_groups
                for p in group["params"]
            ]
        else:
            values = list(v_hat)
            if len(values) != len(params):
                raise ValueError(
                    f"Invalid v_hat: got {len(values)} tensors for "
                    f"{len(params)} parameters"
                )
            values = [torch.as_tensor(v) for v in values]
            for i, (p, v) in enumerate(zip(params, values, strict=True)):
                if v.shape != p.shape:
                    raise ValueError(
                        f"Invalid v_hat[{i}]: shape {tuple(v.shape)}, expected "
                        f"{tuple(p.shape)}"
                    )
                if v.is_complex() or not bool(torch.isfinite(v).all()):
                    raise ValueError(f"Invalid v_hat[{i}]: values must be finite")
                if bool((v < 0).any()):
                    raise ValueError(f"Invalid v_hat[{i}]: values must be >= 0")
        for p, v in zip(params, values, strict=True):
            self._fill_state(p, v)

    @torch.no_grad()
    def second_moments(self) -> list[Tensor]:
        """Return copies of the raw second moments v, in parameter order.

        This is what the client sends to the server at the end of a round
        (LAMB Algorithm 1 line 13 and Fig. 1 both say v): the raw EMA v, not
        the local max v̂_loc. A parameter with no state yet reports v̂_0 = ε·1.

        Returns
        -------
        list of Tensor
            One tensor per parameter, same shape, device and dtype.
        """
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "exp_avg_sq" in state:
                    out.append(state["exp_avg_sq"].clone())
                else:
                    out.append(torch.full_like(p, group["eps"]))
        return out


class FedLAMB(_LocalAMSGrad):
    r"""Fed-LAMB client optimizer (LAMB Algorithm 1, arXiv:2110.00532).

    Local AMSGrad warm-started from the server's v̂, with a layerwise step per
    parameter tensor (LAMB Algorithm 1 line 12; the paper does not define a
    "layer", we take one parameter tensor, weight and bias separately)::

        u = m̂/(sqrt(v̂_loc)+ε) + λθ
        θ ← θ − α · φ(‖θ‖)/‖u‖ · u      (ratio 1 when ‖θ‖ = 0 or ‖u‖ = 0)

    so each tensor moves by exactly α·φ(‖θ‖) when both norms are non-zero.

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups.
    lr : float, optional
        α. Defaults to 1e-2 (our choice: the paper does not state its α).
    betas : tuple of float, optional
        (β1, β2), each in [0, 1). Defaults to (0.9, 0.999) (LAMB §4).
    eps : float, optional
        ε, also the initial v̂_0 = ε·1 (LAMB Algorithm 1 line 2; the paper
        does not state ε). Defaults to 1e-8.
    weight_decay : float, optional
        λ >= 0 (LAMB Algorithm 1 line 12). Line 1 asks for ]0, 1[ but
        LAMB §4 tunes over {0, 0.01, 0.1} and Thm 1 uses 0, so any λ >= 0 is
        accepted. Defaults to 0.01.
    bias_correction_m : bool, optional
        Divide m by 1−β1^t (LAMB Algorithm 1 line 8). Defaults to True.
    bias_correction_v : bool, optional
        Bias-correct v̂_loc in the denominator only, never v itself (see the
        module docstring). Defaults to False.
    phi_bounds : tuple of float or None, optional
        ``(lo, hi)`` with 0 <= lo <= hi, hi > 0: φ(z) = clip(z, lo, hi).
        ``None``: the identity (LAMB §4), with ratio 1 for a zero norm.
        Defaults to None.
    foreach : bool or None, optional
        Use the ``torch._foreach_*`` path (same values as the for-loop path).
        ``None``: foreach when all parameters are on CUDA, or all on CPU and
        small (at most 32,768 elements per tensor on average, per group);
        else the for-loop path. Defaults to None.

    Notes
    -----
    Round protocol: call :meth:`load_second_moments` with the server's v̂ at
    the start of each round (``None`` in round 1), then send
    :meth:`second_moments` with the model. State keys follow torch's Adam:
    ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``. Parameters
    without a gradient are skipped and their t does not advance.
    Hyperparameters must be Python numbers (no tensor ``lr``).

    The foreach path issues a fixed number of operations per step whatever
    the number of tensors, and reads the per-tensor norms back to the host
    once per step (one synchronisation on CUDA): the trust ratios are then
    computed on the host and, as plain numbers, keep the final scaling on
    the fused ``_foreach_mul_`` kernel, where 0-d device tensors would cost
    one kernel launch per tensor.
    """

    _trust_ratio = True

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        bias_correction_m: bool = True,
        bias_correction_v: bool = False,
        phi_bounds: tuple[float, float] | None = None,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": check_scalar("lr", lr, low=0.0),
            "betas": _check_betas(betas),
            "eps": check_scalar("eps", eps, low=0.0),
            "weight_decay": check_scalar("weight_decay", weight_decay, low=0.0),
            "bias_correction_m": _check_flag("bias_correction_m", bias_correction_m),
            "bias_correction_v": _check_flag("bias_correction_v", bias_correction_v),
            "phi_bounds": _check_phi_bounds(phi_bounds),
            "foreach": _check_foreach(foreach),
        }
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("phi_bounds", None)


class FedAMS(_LocalAMSGrad):
    r"""Fed-AMS client optimizer: local AMSGrad with a shared v̂.

    The Local AMSGrad baseline of LAMB (arXiv:2110.00532 §1, §4; the paper
    does not write it out): the same client and server as Fed-LAMB, with LAMB
    Algorithm 1 line 12 replaced by ``θ ← θ − α · m̂/(sqrt(v̂_loc)+ε)``.
    There is no λ (it only enters the trust-ratio step).

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups.
    lr : float, optional
        α. Defaults to 1e-3 (our choice: the paper does not state its α).
    betas : tuple of float, optional
        (β1, β2), each in [0, 1). Defaults to (0.9, 0.999) (LAMB §4).
    eps : float, optional
        ε, also the initial v̂_0 = ε·1 (LAMB Algorithm 1 line 2). Defaults to
        1e-8.
    bias_correction_m : bool, optional
        Divide m by 1−β1^t. Defaults to True.
    bias_correction_v : bool, optional
        Bias-correct v̂_loc in the denominator only; with v̂_0 = 0 in round 1
        this is ``torch.optim.Adam(amsgrad=True)`` (tested against it).
        Defaults to False.
    foreach : bool or None, optional
        Use the ``torch._foreach_*`` path. ``None``: foreach when all
        parameters are on CUDA, or all on CPU and small (as in
        :class:`FedLAMB`). Defaults to None.

    Notes
    -----
    Round protocol and state keys as in :class:`FedLAMB`.
    """

    _trust_ratio = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        bias_correction_m: bool = True,
        bias_correction_v: bool = False,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": check_scalar("lr", lr, low=0.0),
            "betas": _check_betas(betas),
            "eps": check_scalar("eps", eps, low=0.0),
            "bias_correction_m": _check_flag("bias_correction_m", bias_correction_m),
            "bias_correction_v": _check_flag("bias_correction_v", bias_correction_v),
            "foreach": _check_foreach(foreach),
        }
        super().__init__(params, defaults)
