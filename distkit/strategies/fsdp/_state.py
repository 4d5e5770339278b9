"""FSDP2's sharded model and optimizer state to and from distkit's neutral (full) form.

``fully_shard`` replaces every parameter with a DTensor that holds this rank's dim-0 shard,
and the optimizer's per-parameter tensors follow the same layout. distkit's checkpoints hold
full tensors keyed as the plain module and the torch optimizer key them, so that every
strategy reads them. Gathering is a collective (every rank, in the same order); the way
back is not: each rank holds the full state (it read the file) and keeps its own slice.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn


def gathered(value: Any) -> Any:
    """A tensor as a full CPU tensor (a DTensor's shards all-gathered); other values as given.

    A DTensor takes an all-gather: every rank calls this for the same tensors in the same order.
    """
    if _is_dtensor(value):
        with _quiet_redistribution():
            full = value.full_tensor().detach().cpu()  # gathered: a new tensor, no second copy
        # where nothing is gathered (each shard group one rank: HSDP with replicate equal to
        # the world size), full_tensor() is this rank's local tensor itself, and on the CPU
        # .cpu() keeps it: a copy, or the "full" state would go on changing with training
        if full.untyped_storage().data_ptr() == value.to_local().untyped_storage().data_ptr():
            return full.clone()
        return full
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


@contextlib.contextmanager
def _quiet_redistribution() -> Iterator[None]:
    """torch warns, on every rank and for every parameter, that a tensor both FSDP and tensor
    parallelism split on dim 0 is gathered in two all-gathers (slower, it says, not wrong):
    a checkpoint of a 2-D layout would print it once per parameter."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def full_model_state(model: nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as full CPU tensors; ``keep=False`` joins the gathers, keeps none."""
    out = {}
    for key, value in model.state_dict().items():
        full = gathered(value)
        if keep:
            out[key] = full
    return out


def full_optimizer_state(optimizer: torch.optim.Optimizer, *, keep: bool = True) -> dict[str, Any]:
    """``optimizer.state_dict()`` with full CPU tensors (keyed by parameter order, as torch's)."""
    state = optimizer.state_dict()
    per_param: dict[Any, dict[str, Any]] = {}
    for index, entries in state["state"].items():
        full = {name: gathered(value) for name, value in entries.items()}
        if keep:
            per_param[index] = full
    return {"state": per_param, "param_groups": state["param_groups"]} if keep else {}


def like(full: torch.Tensor, target: Any) -> torch.Tensor:
    """``full`` laid out as ``target``: this rank's slice of it where ``target`` is a DTensor.

    No communication: every rank slices its own copy of the full tensor.
    """
    if not _is_dtensor(target):
        return full
    from torch.distributed.tensor import distribute_tensor

    local = full.detach().to(target.device)
    return distribute_tensor(local, target.device_mesh, target.placements, src_data_rank=None)


def load_full_model_state(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Load a full state into ``model``, sharded or not (torch's strict key and shape checks)."""
    current = model.state_dict()
    model.load_state_dict(
        {
            key: like(value, current.get(key)) if isinstance(value, torch.Tensor) else value
            for key, value in state.items()
        }
    )


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full optimizer state; tensors shaped like their (sharded) parameter are sliced."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {}
    for index, entries in state["state"].items():
        param = params[int(index)]
        per_param[index] = {
            name: like(value, param) if _shaped_like(value, param) else value
            for name, value in entries.items()
        }
    optimizer.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})


def _shaped_like(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, replaced: Mapping[int, nn.Parameter]
) -> None:
    """Point ``optimizer`` at the parameters ``fully_shard`` put in place of the originals.

    ``replaced`` maps ``id(original)`` to its sharded successor. State the optimizer already
    holds (a checkpoint loaded before the set-up) is full-size: it is sliced like its new
    parameter. The param_group dicts stay the same objects, so LR schedulers bound to the
    optimizer keep working.
    """
    saved = optimizer.state_dict() if optimizer.state else None
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    optimizer.state = defaultdict(dict)
    if saved is not None:
        load_full_optimizer_state(optimizer, saved)


def _is_dtensor(value: Any) -> bool:
    # imported here: torch.distributed.tensor is what FSDPStrategy's set-up checks for
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)
