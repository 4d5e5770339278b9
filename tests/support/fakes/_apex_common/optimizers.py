"""FAKE ``apex.optimizers`` (FusedAdam, FusedSGD, FusedLAMB) for distkit's tests.

Constructor signatures follow real apex (checked against NVIDIA/apex ``apex/optimizers``).
Differences, on purpose:

* Real fused optimizers need apex's CUDA extensions and CUDA tensors (they raise
  ``RuntimeError('apex.optimizers.FusedAdam requires cuda extensions')`` otherwise). The fakes
  run on CPU tensors of any floating dtype.
* The math is plain per-tensor PyTorch written in the same order as ``torch.optim``: FusedAdam
  with ``adam_w_mode=True`` equals ``torch.optim.AdamW``, with ``adam_w_mode=False`` equals
  ``torch.optim.Adam`` (L2 penalty); FusedSGD equals ``torch.optim.SGD``; FusedLAMB implements
  LAMB the way apex's kernel does (global grad-norm clipping, Adam moments, trust ratio).
* Per-parameter state uses torch's keys (``exp_avg``, ``exp_avg_sq``, ``step`` as a float
  tensor; ``momentum_buffer``) so state dicts are interchangeable with torch's optimizers. Real
  FusedAdam/FusedLAMB keep ``step`` in the param group instead.

Like real apex, ``FusedAdam.zero_grad()`` / ``FusedLAMB.zero_grad()`` / ``FusedSGD.zero_grad()``
take no argument (``set_grad_none`` chosen at construction decides); when ``set_grad_none`` is
False they call ``torch.optim.Optimizer.zero_grad()`` with its defaults (which, in torch >= 2.0,
sets grads to None anyway, as real apex then does too). Each construction is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import required

from .recorder import record


def _scalar_step(state: dict[str, Any]) -> torch.Tensor:
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    return state["step"]


def _run_closure(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FusedAdam(torch.optim.Optimizer):
    """Fake of ``apex.optimizers.FusedAdam``: AdamW math, Adam math with ``adam_w_mode=False``.

    CPU fake: no CUDA extension, no fusion. ``capturable`` and ``master_weights`` are accepted
    and stored but change nothing.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        record(
            "optimizers.FusedAdam",
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
            set_grad_none=set_grad_none,
        )

    def zero_grad(self) -> None:  # type: ignore[override]  # real apex: no argument
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: Any = None,
        grad_norms: Any = None,
        grad_scaler: Any = None,
    ) -> Any:
        if any(p is not None for p in (grads, output_params, scale, grad_norms)):
            raise RuntimeError(
                "FusedAdam has been updated.  Simply initialize it identically to "
                "torch.optim.Adam, and call step() with no arguments."
            )
        loss = _run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "FusedAdam does not support sparse gradients, please consider "
                        "SparseAdam instead"
                    )
                grad = p.grad
                state = self.state[p]
                step_t = _scalar_step(state)
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                step_t += 1
                if weight_decay != 0:
                    if self.adam_w_mode:
                        p.mul_(1 - lr * weight_decay)
                    else:
                        grad = grad.add(p, alpha=weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                if group["bias_correction"]:
                    bias_correction1 = 1 - beta1**step
                    bias_correction2 = 1 - beta2**step
                else:
                    bias_correction1 = bias_correction2 = 1.0
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        return loss


class FusedSGD(torch.optim.Optimizer):
    """Fake of ``apex.optimizers.FusedSGD``: ``torch.optim.SGD`` math (CPU, no CUDA extension).

    ``wd_after_momentum=True`` adds the weight decay after the momentum update, as apex's kernel
    does. ``materialize_master_grads`` is accepted and stored; the fake has no master weights.
    """

    def __init__(
        self,
        params: Any,
        lr: float = required,  # type: ignore[assignment]
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
    ) -> None:
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.set_grad_none = set_grad_none
        record(
            "optimizers.FusedSGD",
            lr=None if lr is required else lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
        )

    def zero_grad(self) -> None:  # type: ignore[override]  # real apex: no argument
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _run_closure(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            dampening, weight_decay = group["dampening"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if weight_decay != 0 and not self.wd_after_momentum:
                    grad = grad.add(p, alpha=weight_decay)
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = torch.clone(grad).detach()
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
                if weight_decay != 0 and self.wd_after_momentum:
                    grad = grad.add(p, alpha=weight_decay)
                p.add_(grad, alpha=-lr)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss


class FusedLAMB(torch.optim.Optimizer):
    """Fake of ``apex.optimizers.FusedLAMB`` (CPU, no CUDA extension).

    Same algorithm as apex's kernel: grads divided by ``global_norm / max_grad_norm`` when the
    global grad norm exceeds ``max_grad_norm``; Adam moments (``grad_averaging`` scales the new
    gradient by ``1 - beta1``); decoupled (``adam_w_mode``) or L2 weight decay; the update is
    multiplied by the trust ratio ``||p|| / ||update||`` when ``weight_decay != 0`` or
    ``use_nvlamb`` (and both norms are non-zero).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb
        record(
            "optimizers.FusedLAMB",
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
        )

    def zero_grad(self) -> None:  # type: ignore[override]  # real apex: no argument
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _run_closure(closure)
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return loss
        global_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        ).item()
        max_grad_norm = self.defaults["max_grad_norm"]
        clip = (
            global_norm / max_grad_norm
            if max_grad_norm > 0 and global_norm > max_grad_norm
            else 1.0
        )
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "FusedLAMB does not support sparse gradients, please consider "
                        "SparseAdam instead"
                    )
                state = self.state[p]
                step_t = _scalar_step(state)
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                step_t += 1
                step = step_t.item()
                grad = p.grad / clip
                if not self.adam_w_mode and decay != 0:
                    grad = grad.add(p, alpha=decay)
                exp_avg.mul_(beta1).add_(grad, alpha=beta3)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat = exp_avg / (1 - beta1**step)
                    v_hat = exp_avg_sq / (1 - beta2**step)
                else:
                    m_hat, v_hat = exp_avg, exp_avg_sq
                update = m_hat / (v_hat.sqrt() + eps)
                if self.adam_w_mode and decay != 0:
                    update = update.add(p, alpha=decay)
                ratio = 1.0
                if self.use_nvlamb or decay != 0:
                    p_norm = torch.linalg.vector_norm(p).item()
                    u_norm = torch.linalg.vector_norm(update).item()
                    if p_norm > 0 and u_norm > 0:
                        ratio = p_norm / u_norm
                p.add_(update, alpha=-lr * ratio)
        return loss


__all__ = ["FusedAdam", "FusedLAMB", "FusedSGD"]
