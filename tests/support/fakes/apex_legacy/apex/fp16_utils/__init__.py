"""FAKE ``apex.fp16_utils`` (legacy apex <= 25.04 only; removed in 25.07) for distkit's tests.

Only the small model-casting helpers are provided (real apex also has ``FP16_Optimizer`` and
loss scalers here). Nothing is recorded.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm


def convert_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating-point parameters and buffers (not its children's)."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype=dtype)
            if param.grad is not None and param.grad.is_floating_point():
                param.grad.data = param.grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast every module to ``dtype`` except affine BatchNorm layers (kept fp32, as real apex)."""
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine is True:
            continue
        convert_module(module, dtype)
    return network


def BN_convert_float(module: torch.nn.Module) -> torch.nn.Module:
    """Cast affine BatchNorm layers back to fp32, recursively."""
    if isinstance(module, _BatchNorm) and module.affine is True:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


__all__ = ["BN_convert_float", "convert_module", "convert_network"]
