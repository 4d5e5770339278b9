"""FAKE ``apex.parallel.SyncBatchNorm`` (test double).

A ``torch.nn.modules.batchnorm._BatchNorm`` subclass, like real apex's, that behaves as plain
BatchNorm on CPU: it does NOT synchronise statistics across ranks (real apex all-reduces the
batch mean / squared mean in training mode and needs CUDA for its fast path). It is not a
``torch.nn.SyncBatchNorm``, so torch DDP accepts it on CPU. ``channel_last=True`` is refused as
by real apex's python fallback.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    """Fake of ``apex.parallel.SyncBatchNorm``: plain BatchNorm over any input with >= 2 dims."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        channel_last: bool = False,
        fuse_relu: bool = False,
    ) -> None:
        if channel_last:
            raise AttributeError(
                "channel_last is not supported by primitive SyncBatchNorm implementation. Try "
                "install apex with `--cuda_ext` if channel_last is desired."
            )
        super().__init__(
            num_features,
            eps=eps,
            momentum=momentum,
            affine=affine,
            track_running_stats=track_running_stats,
        )
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group: Any) -> None:
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
