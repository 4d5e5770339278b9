"""What an optimizer step did, and the check behind ``nonfinite="skip"``."""

from __future__ import annotations

import enum

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
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]  # fmt: skip
    if not grads:
        return True
    return bool(torch.stack([g.isfinite().all() for g in grads]).all())
