"""A model built on the meta device, materialised shard by shard under fsdp: no rank holds it
whole.

The model is sharded while it is still on meta (``fully_shard`` takes meta parameters), then
``to_empty`` gives each rank storage for its own slices only. Each module is then given the
initial values of the normal build (:mod:`distkit.strategies._meta_init`), and each rank keeps
its slice of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distkit.strategies import _meta_init

on_meta = _meta_init.on_meta


def materialize(
    model: nn.Module, device: torch.device, rng_state: torch.Tensor, *, main: bool
) -> None:
    """Give ``model`` (sharded or not) storage on ``device`` and initialise every module as
    the normal build would have, from ``rng_state`` (rank 0's; see ``_meta_init.initialise``)."""
    model.to_empty(device=device)

    def keep(module: nn.Module, own: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
        for name, value in values.items():
            _keep_slice(own[name], value, device)

    _meta_init.initialise(model, rng_state, keep, main=main)


def _keep_slice(target: torch.Tensor, full: torch.Tensor, device: torch.device) -> None:
    """This rank's part of ``full`` into ``target`` (a DTensor's local slice, or all of it)."""
    with torch.no_grad():
        if hasattr(target, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            dtensor: Any = target
            piece = distribute_tensor(
                full.to(device), dtensor.device_mesh, dtensor.placements, src_data_rank=None
            )
            dtensor.to_local().copy_(piece.to_local())
        else:
            target.copy_(full.to(device))
