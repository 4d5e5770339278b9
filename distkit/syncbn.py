"""BatchNorm over the global batch, for any backend, CPU included.

``torch.nn.SyncBatchNorm`` (and ``hvd.SyncBatchNorm``) refuse CPU tensors in training. This layer
all-reduces each channel's sum and count, then its sum of squared deviations, through a
differentiable all-reduce the strategy supplies, so its forward *and* backward equal plain
BatchNorm over the whole global batch. It is not a ``SyncBatchNorm`` subclass, so DDP accepts
it on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm (1d/2d/3d inputs) whose training statistics span every rank's batch.

    Args:
        num_features: channels (dimension 1 of the input).
        all_reduce_sum: differentiable sum over ranks (identity in a single process).
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
    """

    def __init__(
        self,
        num_features: int,
        all_reduce_sum: AllReduceSum,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self._all_reduce_sum = all_reduce_sum

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions, got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            # evaluation never communicates: ranks may hold different numbers of batches, so
            # a collective here could wait forever (without running stats: local statistics)
            return super().forward(input)
        factor = self._momentum_factor()
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input.float()
        # two reductions (mean, then squared deviations) rather than E[x^2] - E[x]^2, which
        # cancels catastrophically for features far from zero
        local_count = torch.full((1,), input.numel() / channels, dtype=x.dtype, device=x.device)
        packed = self._all_reduce_sum(torch.cat([x.sum(dims), local_count]))
        count = packed[-1]
        mean = packed[:channels] / count
        shape = [1, channels] + [1] * (input.dim() - 2)
        centered = x - mean.view(shape)
        var = self._all_reduce_sum((centered * centered).sum(dims)) / count
        if self.training and self.track_running_stats and self.running_mean is not None:
            assert self.running_var is not None
            with torch.no_grad():
                unbiased = var * (count / (count - 1).clamp_min(1))
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)
        out = centered * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    def _momentum_factor(self) -> float:
        if not (
            self.training and self.track_running_stats and self.num_batches_tracked is not None
        ):
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average, as torch does
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


def convert_to_global_batchnorm(module: nn.Module, all_reduce_sum: AllReduceSum) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` (in place) with :class:`GlobalBatchNorm`."""

    def make(bn: _BatchNorm) -> nn.Module:
        return GlobalBatchNorm(
            bn.num_features, all_reduce_sum, bn.eps, bn.momentum, bn.affine,
            bn.track_running_stats,
        )  # fmt: skip

    return replace_batchnorm(module, make, skip=GlobalBatchNorm)


def replace_batchnorm(
    module: nn.Module,
    make: Callable[[_BatchNorm], nn.Module],
    *,
    skip: type[nn.Module],
) -> nn.Module:
    """Replace BatchNorm layers (in place) by ``make(layer)``, sharing parameters and buffers.

    Sharing (not copying) keeps an optimizer built on ``module`` valid. Layers that already
    are ``skip`` instances stay. Returns the converted module (a new object only if ``module``
    itself is a BatchNorm layer).
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, skip):
        converted: Any = make(module)
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        new_child = replace_batchnorm(child, make, skip=skip)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
