"""FAKE ``apex.parallel`` (legacy apex <= 25.04) for distkit's tests; no NVIDIA code, CPU only.

Public names as in real apex: ``DistributedDataParallel`` (really all-reduces grads over gloo,
see ``distributed.py``), ``SyncBatchNorm`` (plain BatchNorm on CPU, see ``sync_batchnorm.py``),
``convert_syncbn_model``, ``create_syncbn_process_group`` and ``ReduceOp``. Real apex 25.07+ has
no ``apex.parallel`` at all.
"""

from __future__ import annotations

from typing import Any

import torch

from apex._common.recorder import record

from .distributed import DistributedDataParallel
from .sync_batchnorm import SyncBatchNorm

ReduceOp = torch.distributed.ReduceOp


def _convert(module: torch.nn.Module, process_group: Any, channel_last: bool) -> Any:
    converted = module
    replaced = 0
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
        )
        # as real apex: running stats shared (same tensors), affine params cloned,
        # num_batches_tracked and the train/eval flag not carried over
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        if module.affine:
            converted.weight.data = module.weight.data.clone().detach()
            converted.bias.data = module.bias.data.clone().detach()
        replaced += 1
    for name, child in module.named_children():
        new_child, count = _convert(child, process_group, channel_last)
        converted.add_module(name, new_child)
        replaced += count
    return converted, replaced


def convert_syncbn_model(
    module: torch.nn.Module, process_group: Any = None, channel_last: bool = False
) -> torch.nn.Module:
    """Recursively replace every ``_BatchNorm`` in ``module`` with ``apex.parallel.SyncBatchNorm``.

    Returns the converted module (the same object unless ``module`` itself is a BatchNorm).
    """
    converted, replaced = _convert(module, process_group, channel_last)
    record("parallel.convert_syncbn_model", replaced=replaced, channel_last=channel_last)
    return converted


def create_syncbn_process_group(group_size: int) -> Any:
    """Groups of ``group_size`` consecutive ranks; returns the calling rank's group (or None)."""
    if group_size == 0:
        return None
    world_size = torch.distributed.get_world_size()
    assert world_size >= group_size
    assert world_size % group_size == 0
    group = None
    for group_num in range(world_size // group_size):
        ranks = list(range(group_num * group_size, (group_num + 1) * group_size))
        current = torch.distributed.new_group(ranks=ranks)
        if torch.distributed.get_rank() // group_size == group_num:
            group = current
    assert group is not None
    return group


__all__ = [
    "DistributedDataParallel",
    "ReduceOp",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]
