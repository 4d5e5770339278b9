"""Exponential moving averages of a module's parameters: the tensors behind the EMA callback.

Each average is a tensor of at least float32 (a float64 parameter's is float64, a bf16 one's
float32: :func:`average_dtype`), laid out as its parameter is on this rank: a plain tensor,
or, where a parameter is a DTensor (fsdp's ``fully_shard``), this rank's local shard of it.
Updating and swapping therefore touch only local memory (no collective); reading the averages
whole (:func:`full_averages`) gathers the shards, a collective, and going back
(:func:`local_averages`) slices each rank's own part of the full tensors without one.
Buffers (BatchNorm's running statistics) are not averaged: the module's own stay in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from distkit.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Averages = dict[str, torch.Tensor]


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters by name, each as this rank's local tensor (a DTensor's shard),
    with every sharded unit let go of its gathered parameters first (see :func:`resharded`)."""
    resharded(module)
    return {name: _local(p) for name, p in module.named_parameters()}


def average_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` is averaged in: float32 for the narrower floats
    (bf16, fp16: an update of ``(1 - decay) * difference`` would round away), the parameter's
    own where it is wider (a float64 model's averages are float64, not cut to float32)."""
    return torch.promote_types(dtype, torch.float32)


def averages_of(module: nn.Module) -> Averages:
    """Fresh averages: copies of ``module``'s parameters (this rank's shards), each in
    :func:`average_dtype` of its parameter."""
    return {
        name: w.detach().to(average_dtype(w.dtype), copy=True)
        for name, w in weights(module).items()
    }


@torch.no_grad()
def update_(averages: Averages, module: nn.Module, decay: float) -> None:
    """``average = decay * average + (1 - decay) * parameter``, in place, for each one."""
    current = weights(module)
    targets = [averages[name] for name in current]
    sources = [w.detach().to(t.dtype) for w, t in zip(current.values(), targets, strict=True)]
    for group_targets, group_sources in _by_device(targets, sources):
        torch._foreach_lerp_(group_targets, group_sources, 1.0 - decay)


@torch.no_grad()
def copy_into(module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Write ``values`` (local tensors keyed like :func:`weights`) into ``module``'s
    parameters, cast to each parameter's dtype."""
    for name, w in weights(module).items():
        w.copy_(values[name])


def trained_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s parameters as they are (local tensors, their own dtype)."""
    return {name: w.detach().clone() for name, w in weights(module).items()}


def full_averages(averages: Averages, module: nn.Module) -> Averages:
    """The averages as full CPU tensors keyed like ``module``'s parameters.

    A collective where parameters are sharded (each DTensor's shards are all-gathered): call
    it on every rank, for the same module, in the same order.
    """
    resharded(module)
    out = {}
    for name, p in module.named_parameters():
        average, sharded = averages[name], _as_dtensor(p)
        if sharded is not None:
            from torch.distributed.tensor import DTensor

            whole = DTensor.from_local(
                average,
                sharded.device_mesh,
                sharded.placements,
                run_check=False,
                shape=sharded.shape,
                stride=sharded.stride(),
            )
            full = whole.full_tensor().cpu()
            # nothing to gather (HSDP whose shard groups are one rank each): full_tensor() is
            # the running average itself, which would go on changing; copy it then
            shares = full.untyped_storage().data_ptr() == average.untyped_storage().data_ptr()
            out[name] = full.clone() if shares else full
        else:
            out[name] = average.detach().to("cpu", copy=True)
    return out


def local_averages(full: Mapping[str, torch.Tensor], module: nn.Module, *, what: str) -> Averages:
    """Full averages (:func:`full_averages`, read from a checkpoint) laid out as ``module``'s
    parameters on this rank: its own slice of each sharded one (no communication).

    Raises:
        CheckpointError: the names or shapes are not ``module``'s (``what`` says whose
            averages they are, for the message).
    """
    resharded(module)
    params = dict(module.named_parameters())
    missing, unknown = sorted(set(params) - set(full)), sorted(set(full) - set(params))
    wrong = [
        f"{name} {tuple(full[name].shape)} (the model's: {tuple(p.shape)})"
        for name, p in params.items()
        if name in full and tuple(full[name].shape) != tuple(p.shape)
    ]
    if missing or unknown or wrong:
        raise CheckpointError(
            f"{what} do not fit the model: missing {missing or 'none'}, unknown "
            f"{unknown or 'none'}, other shapes {wrong or 'none'}. Resume with the model "
            "they were saved for, or start the averages afresh (a new EMA without the state)"
        )
    out = {}
    for name, p in params.items():
        value = full[name].detach().to(device=p.device, dtype=average_dtype(p.dtype))
        sharded = _as_dtensor(p)
        if sharded is not None:
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(
                value, sharded.device_mesh, sharded.placements, src_data_rank=None
            ).to_local()
        out[name] = value.clone()
    return out


def resharded(module: nn.Module) -> None:
    """Let every FSDP2 unit of ``module`` go of its gathered parameters (no communication).

    FSDP2 keeps the root unit's parameters gathered after a forward pass (it expects a
    backward next), as plain full tensors in place of the sharded ones; after an evaluation
    they stay so. The averages live in the shards, so they are read and written there, and
    the next forward pass gathers what they hold.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing can be sharded
        return
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _local(p: torch.Tensor) -> torch.Tensor:
    sharded = _as_dtensor(p)
    return p if sharded is None else sharded.to_local()


def _as_dtensor(value: object) -> DTensor | None:
    """``value`` where it is a DTensor (a sharded parameter), else None."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is sharded
        return None
    return value if isinstance(value, DTensor) else None


def _by_device(
    targets: list[torch.Tensor], sources: list[torch.Tensor]
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """``_foreach`` ops take one device per call: the pairs grouped by device."""
    groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources, strict=True):
        group = groups.setdefault(target.device, ([], []))
        group[0].append(target)
        group[1].append(source.to(target.device))
    return list(groups.values())
