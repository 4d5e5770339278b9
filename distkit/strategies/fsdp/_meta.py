"""A model built on the meta device, materialised shard by shard under fsdp: no rank holds it
whole.

The model is sharded while it is still on meta (``fully_shard`` takes meta parameters), then
``to_empty`` gives each rank storage for its own slices only, keeping each parameter object
(so a tied weight stays one parameter; see ``_tied_weights``). Each module is
then given the initial values of the normal build (:mod:`distkit.strategies._meta_init`), or
the weights ``load_weights`` recorded for it, and each rank keeps its slice of them: of a
recorded weight it reads only its own rows from the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distkit.checkpoint._pending_weights import StoredTensor
from distkit.strategies import _meta_init, _tied_weights

on_meta = _meta_init.on_meta


def materialize(
    model: nn.Module,
    device: torch.device,
    rng_state: torch.Tensor,
    *,
    main: bool,
    stored: Mapping[str, StoredTensor] | None = None,
) -> None:
    """Give ``model`` (sharded or not) storage on ``device`` and initialise every module as
    the normal build would have, from ``rng_state`` (rank 0's; see ``_meta_init.initialise``),
    or from the ``stored`` weights where they hold a tensor."""
    with _tied_weights.keeping_parameters():
        model.to_empty(device=device)

    def keep(
        module: nn.Module, own: dict[str, torch.Tensor], values: dict[str, _meta_init.Value]
    ) -> None:
        for name, value in values.items():
            _keep_slice(own[name], value, device)

    _meta_init.initialise(model, rng_state, keep, main=main, stored=stored or None)


def _keep_slice(target: torch.Tensor, value: _meta_init.Value, device: torch.device) -> None:
    """This rank's part of ``value`` into ``target`` (a DTensor's local slice, or all of it);
    a stored value sharded on its first dimension is read for this rank's rows only."""
    with torch.no_grad():
        rows = _local_rows(target) if isinstance(value, StoredTensor) else None
        if rows is not None:
            assert isinstance(value, StoredTensor)
            local: Any = target
            local.to_local().copy_(value.read(rows).to(device))
            return
        full = _meta_init.full(value)
        if hasattr(target, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            dtensor: Any = target
            piece = distribute_tensor(
                full.to(device), dtensor.device_mesh, dtensor.placements, src_data_rank=None
            )
            dtensor.to_local().copy_(piece.to_local())
        else:
            target.copy_(full.to(device))


def _local_rows(target: torch.Tensor) -> tuple[int, int] | None:
    """The rows ``[start, stop)`` of the full tensor that this rank's slice of ``target``
    holds, where FSDP2 shards it on dim 0 over one mesh dimension (``torch.chunk``'s split)
    and replicates it over any other; None for any other layout (or a plain tensor)."""
    mesh = getattr(target, "device_mesh", None)
    if mesh is None or target.dim() == 0:
        return None
    from torch.distributed.tensor import Replicate, Shard

    dtensor: Any = target
    placements = list(dtensor.placements)
    sharded = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == 0]
    others = [p for i, p in enumerate(placements) if i not in sharded]
    if len(sharded) != 1 or not all(isinstance(p, Replicate) for p in others):
        return None
    count, index = mesh.size(sharded[0]), mesh.get_local_rank(sharded[0])
    rows = target.shape[0]
    chunk = -(-rows // count)
    start = min(index * chunk, rows)
    stop = min(start + chunk, rows)
    local = dtensor.to_local()
    if tuple(local.shape) != (stop - start, *target.shape[1:]):
        return None  # not the split assumed: read whole, and let torch cut it
    return start, stop
