"""What an optimizer step did, the check behind ``nonfinite="skip"``, and gradient clipping."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class StepOutcome(enum.Enum):
    """The result of :meth:`~distkit.Strategy.optimizer_step` (the same on every rank)."""

    STEPPED = "stepped"
    #: ``nonfinite="skip"``: the averaged gradients held NaN/inf; nothing was changed
    SKIPPED_NONFINITE = "skipped: non-finite gradients"
    #: fp16: the loss scaler found inf/NaN in the scaled gradients and lowered its scale
    SKIPPED_OVERFLOW = "skipped: fp16 overflow"

    @property
    def stepped(self) -> bool:
        return self is StepOutcome.STEPPED

    @classmethod
    def of(cls, stepped: bool) -> StepOutcome:
        """STEPPED, or SKIPPED_OVERFLOW when a loss scaler skipped the step."""
        return cls.STEPPED if stepped else cls.SKIPPED_OVERFLOW


def gradients_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite (one host sync)."""
    grads = step_gradients(optimizer)
    if not grads:
        return True
    return bool(torch.stack([g.isfinite().all() for g in grads]).all())


@dataclass(frozen=True)
class GradientClip:
    """How the averaged, unscaled gradients are clipped before each optimizer step.

    Attributes:
        max_norm: scale all gradients together so that their total 2-norm is at most this
            (``torch.nn.utils.clip_grad_norm_``'s rule); None: no norm clipping.
        max_value: then clamp every gradient element into ``[-max_value, max_value]``;
            None: no value clipping.
    """

    max_norm: float | None = None
    max_value: float | None = None

    @classmethod
    def from_settings(cls, norm: float | None, value: float | None) -> GradientClip | None:
        """The clip for the trainer's ``gradient_clip_norm`` / ``gradient_clip_value``."""
        return None if norm is None and value is None else cls(norm, value)


def step_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients the optimizer's next step applies (None ones left out)."""
    return [
        p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    ]


def clip_(grads: list[torch.Tensor], clip: GradientClip, total_norm: torch.Tensor) -> torch.Tensor:
    """Clip ``grads`` in place given their ``total_norm`` over every rank; returns it.

    No host synchronisation: the scale factor stays a device tensor (a NaN/inf norm makes
    the gradients NaN, which the step's finiteness check or the loss scaler then catches).
    """
    if clip.max_norm is not None and grads:
        coefficient = (clip.max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for device_grads in _by_device(grads):
            torch._foreach_mul_(device_grads, coefficient.to(device_grads[0].device))
    if clip.max_value is not None:
        for grad in grads:
            grad.clamp_(-clip.max_value, clip.max_value)
    return total_norm


def scale_(grads: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``factor`` (a number, or a scalar tensor that stays on
    its device: no host synchronisation)."""
    for device_grads in _by_device(grads):
        first = device_grads[0]
        if isinstance(factor, torch.Tensor):
            torch._foreach_mul_(device_grads, factor.to(first.device, first.dtype))
        else:
            torch._foreach_mul_(device_grads, factor)


def local_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of ``grads`` together (fp32 or wider, on ``device``; 0 without any)."""
    if not grads:
        return torch.zeros((), device=device)
    norms = [torch.linalg.vector_norm(g.detach(), 2.0, dtype=_norm_dtype(g)) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def _norm_dtype(grad: torch.Tensor) -> torch.dtype:
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


def _by_device(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return list(groups.values())
