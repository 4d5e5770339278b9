"""BatchNorm over the global batch, for any backend, CPU included.

``torch.nn.SyncBatchNorm`` (and ``hvd.SyncBatchNorm``) refuse CPU tensors in training. This layer
all-reduces each channel's sum and count, then its sum of squared deviations, through a
differentiable all-reduce the strategy supplies, so its forward *and* backward equal plain
BatchNorm over the whole global batch. It is not a ``SyncBatchNorm`` subclass, so DDP accepts
it on CPU.

Placeholders. A rank with no real sample in a short last global batch trains on one
placeholder sample of loss weight 0 (see :mod:`distkit.data`). Inside :func:`placeholder_batch`
the sync-BN layers count that rank's batch as empty: they still join every collective (no rank
waits), but add nothing to the mean, the variance or the running statistics, so an uneven last
batch normalises exactly as one process with the whole global batch would. Which layer each
backend uses, and why:

* CPU, every backend: :class:`GlobalBatchNorm` (sum and count zero for a placeholder).
* DDP and apex on CUDA: :class:`MaskedSyncBatchNorm`, torch's ``SyncBatchNorm`` fed an empty
  batch for a placeholder (torch drops zero counts from its statistics, in forward and
  backward). Legacy apex's ``apex.parallel.SyncBatchNorm`` is not used: it takes no empty
  batch, so it has no way to count a placeholder as no sample.
* Horovod on CUDA: :class:`GlobalBatchNorm` over ``hvd.allreduce``; ``hvd.SyncBatchNorm``
  cannot take an empty batch (no zero-count filtering).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm (1d/2d/3d inputs) whose training statistics span every rank's batch.

    A rank whose batch is only a placeholder (``placeholder`` set, by :func:`placeholder_batch`)
    adds no sample to the statistics but still takes part in every all-reduce.

    Args:
        num_features: channels (dimension 1 of the input).
        all_reduce_sum: differentiable sum over ranks (identity in a single process).
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
    """

    #: this rank's batch holds no real sample (set by :func:`placeholder_batch`)
    placeholder: bool = False

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

    @override
    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions, got {input.dim()}D")

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            # evaluation never communicates: ranks may hold different numbers of batches, so
            # a collective here could wait forever (without running stats: local statistics)
            return super().forward(input)
        factor = self._momentum_factor()
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        # fp16/bf16 to float32 for the statistics; float64 stays float64 (a .float() here
        # computed a float64 model's statistics in float32: 7e-8 off one process, silently)
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        # two reductions (mean, then squared deviations) rather than E[x^2] - E[x]^2, which
        # cancels catastrophically for features far from zero
        local_sum = x.sum(dims)
        local_count = torch.full((1,), input.numel() / channels, dtype=x.dtype, device=x.device)
        if self.placeholder:
            # nothing to add, but stay in the graph so this rank joins the backward all-reduce
            local_sum, local_count = local_sum * 0, local_count * 0
        packed = self._all_reduce_sum(torch.cat([local_sum, local_count]))
        count = packed[-1]
        mean = packed[:channels] / count
        shape = [1, channels] + [1] * (input.dim() - 2)
        centered = x - mean.view(shape)
        squares = (centered * centered).sum(dims)
        var = self._all_reduce_sum(squares * 0 if self.placeholder else squares) / count
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


class MaskedSyncBatchNorm(nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` that leaves a placeholder batch out of every statistic.

    For a placeholder (inside :func:`placeholder_batch`, in training) torch's layer runs on an
    empty batch, so this rank joins the statistics all-gather and, in backward, the gradient
    all-reduce with a count of zero. The placeholder's own output is a stand-in (the input
    normalised by the running statistics, already updated with the global batch's): finite and
    tied into the graph, and its loss weight is 0.
    """

    #: this rank's batch holds no real sample (set by :func:`placeholder_batch`)
    placeholder: bool = False

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.placeholder and self.training):
            return super().forward(input)
        # in the dtype the other ranks' statistics have (fp32 for fp16/bf16 input): torch
        # builds an empty batch's zeros in the input's dtype, and collectives need one dtype
        stats_dtype = torch.promote_types(input.dtype, torch.float32)
        empty = super().forward(input[:0].to(stats_dtype))
        return self._stand_in(input) + empty.sum()  # the sum of nothing: 0, but in the graph

    def _stand_in(self, input: torch.Tensor) -> torch.Tensor:
        mean, var = self.running_mean, self.running_var
        if mean is None or var is None:
            dtype = torch.promote_types(input.dtype, torch.float32)
            mean = torch.zeros(self.num_features, dtype=dtype, device=input.device)
            var = torch.ones_like(mean)
        return F.batch_norm(input, mean, var, self.weight, self.bias, False, 0.0, self.eps)


MASKED_BATCHNORMS = (GlobalBatchNorm, MaskedSyncBatchNorm)


@contextlib.contextmanager
def placeholder_batch(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s sync-BN layers count this rank's batch as holding no sample.

    Enter it around the forward pass of a placeholder micro-batch (count 0, loss weight 0).
    Other BatchNorm layers are left alone: a per-rank BatchNorm never sees other ranks' samples.
    """
    layers = [layer for layer in model.modules() if isinstance(layer, MASKED_BATCHNORMS)]
    for layer in layers:
        layer.placeholder = True
    try:
        yield
    finally:
        for layer in layers:
            layer.placeholder = False


def convert_to_masked_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` (in place) with :class:`MaskedSyncBatchNorm`."""

    def make(bn: _BatchNorm) -> nn.Module:
        return MaskedSyncBatchNorm(
            bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats
        )

    return replace_batchnorm(module, make, skip=MaskedSyncBatchNorm)


def convert_to_global_batchnorm(module: nn.Module, all_reduce_sum: AllReduceSum) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` (in place) with :class:`GlobalBatchNorm`."""

    def make(bn: _BatchNorm) -> nn.Module:
        return GlobalBatchNorm(
            bn.num_features,
            all_reduce_sum,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
        )

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
