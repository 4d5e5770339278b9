"""FAKE ``apex.amp.scaler.LossScaler`` (test double, CPU, python path of real apex).

Behaviour mirrored from real apex: a ``"dynamic"`` scaler starts at ``init_scale`` (2**16),
halves on overflow (never below ``min_loss_scale`` when one is set) and doubles, up to
``max_loss_scale``, after ``scale_window`` (2000) consecutive unskipped steps; a static scaler
keeps its value, never checks for overflow and never skips. Unscaling multiplies grads by
``1 / loss_scale`` in place; overflow is detected (dynamic only) when a gradient's sum is not
finite, as real apex's python fallback does. Real apex allocates a ``torch.cuda.IntTensor`` here
and fails without CUDA; the fake does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def _has_inf_or_nan(grad: torch.Tensor) -> bool:
    return not math.isfinite(float(grad.float().sum()))


class LossScaler:
    """One loss scale (``amp.initialize(num_losses=N)`` creates N of them)."""

    def __init__(
        self,
        loss_scale: Any,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = float(init_scale)
        else:
            self.dynamic = False
            self._loss_scale = float(loss_scale)
        self._scale_factor = scale_factor
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False

    def loss_scale(self) -> float:
        return self._loss_scale

    def clear_overflow_state(self) -> None:
        self._has_overflow = False

    def unscale(
        self,
        model_grads: Sequence[torch.Tensor],
        master_grads: Sequence[torch.Tensor],
        unused_scale: Any = None,
        models_are_masters: bool = False,
        scale_override: float | None = None,
    ) -> None:
        """``master = model / scale`` for each pair; stop at the first overflow (dynamic)."""
        if self._has_overflow:
            return
        scale = self._loss_scale if scale_override is None else scale_override
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        for model, master in zip(model_grads, master_grads, strict=True):
            if model is None:
                continue
            if self.dynamic and _has_inf_or_nan(model):
                self._has_overflow = True
                break
            if master is not model:
                master.copy_(model)
            if scale != 1.0:
                master.mul_(1.0 / scale)

    def unscale_with_stashed(
        self,
        model_grads: Sequence[torch.Tensor],
        stashed_master_grads: Sequence[torch.Tensor],
        master_grads: Sequence[torch.Tensor],
        scale_override: tuple[float, float, float] | None = None,
    ) -> None:
        """``master = model / scale + stashed`` (accumulation across backward passes)."""
        if self._has_overflow:
            return
        grads_have_scale, stashed_have_scale, out_scale = (
            (self._loss_scale, 1.0, 1.0) if scale_override is None else scale_override
        )
        grads = zip(model_grads, stashed_master_grads, master_grads, strict=True)
        for model, stashed, master in grads:
            if model is None and stashed is None:
                continue
            if self.dynamic and _has_inf_or_nan(model):
                self._has_overflow = True
                break
            combined = model.to(stashed.dtype) * (out_scale / grads_have_scale) + stashed * (
                out_scale / stashed_have_scale
            )
            master.data = combined

    def update_scale(self) -> bool:
        """Apply the last unscale's overflow verdict; True means: skip the next step."""
        if self._has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / self._scale_factor)
            else:
                self._loss_scale = self._loss_scale / self._scale_factor
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._scale_factor)
            self._unskipped = 0
        return should_skip
