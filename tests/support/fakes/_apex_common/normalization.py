"""FAKE ``apex.normalization`` (FusedLayerNorm, FusedRMSNorm) for distkit's tests.

Real apex implements these as ``torch.nn.Module`` subclasses backed by CUDA kernels, with
parameters ``weight`` (and ``bias`` for LayerNorm) when ``elementwise_affine``. The fakes run on
CPU: ``FusedLayerNorm`` is a ``torch.nn.LayerNorm`` subclass (same state-dict keys),
``FusedRMSNorm`` a small RMSNorm. Each construction is recorded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .recorder import record


def _shape(normalized_shape: Any) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(n) for n in normalized_shape)


class FusedLayerNorm(nn.LayerNorm):
    """Fake of ``apex.normalization.FusedLayerNorm``: plain ``nn.LayerNorm`` on CPU."""

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__(_shape(normalized_shape), eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient
        record(
            "normalization.FusedLayerNorm",
            normalized_shape=_shape(normalized_shape),
            eps=eps,
            elementwise_affine=elementwise_affine,
        )


class FusedRMSNorm(nn.Module):
    """Fake of ``apex.normalization.FusedRMSNorm``: ``x / sqrt(mean(x**2) + eps) * weight``."""

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        record(
            "normalization.FusedRMSNorm",
            normalized_shape=self.normalized_shape,
            eps=eps,
            elementwise_affine=elementwise_affine,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        variance = input.float().pow(2).mean(dim=dims, keepdim=True)
        out = (input.float() * torch.rsqrt(variance + self.eps)).to(input.dtype)
        return out * self.weight if self.weight is not None else out

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


__all__ = ["FusedLayerNorm", "FusedRMSNorm"]
