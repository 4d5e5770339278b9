"""The parallel layout of an FSDPStrategy: one DeviceMesh ``(replicate, shard, tensor)``.

Ranks are laid out row-major, the tensor-parallel dimension innermost (the ``T`` consecutive
ranks of one node split each layer; across them, the data-parallel ranks shard and
replicate). The ``T`` ranks of a tensor-parallel group see the same samples: the data's rank
is the rank's place in ``(replicate, shard)``, and only the group's first rank (tensor
coordinate 0) counts what its group computed, where sums over the world would count it ``T``
times (see ``Strategy.data_leader``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distkit.errors import ConfigurationError
from distkit.strategies.base import Topology

DIMS = ("replicate", "shard", "tensor")


@dataclass(frozen=True)
class Layout:
    """``replicate x shard x tensor`` ranks; ``mesh`` is None in a layout without tensor
    parallelism (``tensor == 1``), where FSDP keeps the meshes it always had."""

    replicate: int
    shard: int
    tensor: int
    rank: int
    mesh: Any = None

    @property
    def data_world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def data_rank(self) -> int:
        return self.rank // self.tensor

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    def dp_mesh(self) -> Any:
        """The (sub)mesh FSDP shards over: ``shard``, or ``(replicate, shard)`` under HSDP."""
        return self.mesh["replicate", "shard"] if self.replicate > 1 else self.mesh["shard"]

    def tp_mesh(self) -> Any:
        return self.mesh["tensor"]

    def words(self) -> str:
        return f"replicate={self.replicate} x shard={self.shard} x tensor={self.tensor}"


def layout_for(topology: Topology, replicate: int, tensor: int) -> Layout:
    """The layout of ``topology``'s world, its mesh built where tensor parallelism needs it
    (a collective: every rank builds the same mesh)."""
    world = topology.world_size
    if world % (replicate * tensor):
        raise ConfigurationError(
            f"FSDPStrategy(replicate={replicate}, tensor_parallel={tensor}) needs a world size "
            f"that is a multiple of replicate x tensor_parallel = {replicate * tensor}; this job "
            f"has {world} ranks. Choose replicate and tensor_parallel whose product divides "
            f"{world}, or launch a multiple of {replicate * tensor} ranks"
        )
    shard = world // (replicate * tensor)
    if tensor == 1:
        return Layout(replicate, shard, 1, topology.rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(topology.device.type, (replicate, shard, tensor), mesh_dim_names=DIMS)
    return Layout(replicate, shard, tensor, topology.rank, mesh)


def reduce_partial_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Sum, in place, the gradients left as partial sums over a mesh dimension: a parameter
    kept whole on every rank of a group whose activations are split over the sequence (a
    norm's, under ``"sequence"``) gets from each rank the gradient of its part of the
    sequence. The optimizer would sum them when it reads them; a norm taken per shard (for
    clipping) needs them summed first."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            placements = getattr(grad, "placements", ())
            if any(p.is_partial() for p in placements):
                from torch.distributed.tensor import Replicate

                whole = [Replicate() if p.is_partial() else p for p in placements]
                param.grad = grad.redistribute(grad.device_mesh, whole)


class CopyCount:
    """:func:`counted_once` for each gradient, remembered per (mesh, placements): the answer
    reads the mesh's rank table, a tensor, which a step should not (no host reads per step)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        #: (id of the mesh, placements) -> (the mesh, kept so that its id is not reused, answer)
        self._known: dict[tuple[int, tuple[Any, ...]], tuple[Any, bool]] = {}

    def __call__(self, value: torch.Tensor) -> bool:
        mesh = getattr(value, "device_mesh", None)
        if mesh is None:
            return self.rank == 0
        key = (id(mesh), tuple(value.placements))  # type: ignore[attr-defined]
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = (mesh, counted_once(value, self.rank))
        return known[1]


def counted_once(value: torch.Tensor, rank: int) -> bool:
    """Whether this rank's part of ``value`` (a gradient) is the one copy a sum over the
    world counts: every rank holds some form of every parameter, and the copies of one
    part sit on the ranks that differ only in a mesh dimension that does not split it (a
    ``Replicate`` dimension of its DTensor mesh, or a dimension outside that mesh: a norm
    sharded over ``shard`` alone is copied over ``tensor``). The copy counted is the one on
    the mesh through rank 0, at coordinate 0 of every replicating dimension. A plain tensor is
    whole on every rank: rank 0's counts."""
    mesh = getattr(value, "device_mesh", None)
    if mesh is None:
        return rank == 0
    placements = value.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):  # reduce_partial_gradients first
        raise ConfigurationError(
            f"a gradient is a partial sum (placements {tuple(placements)}) when its norm is "
            "taken: distkit sums such gradients before clipping; this one was left partial"
        )
    if not bool((mesh.mesh == 0).any()):
        return False
    coordinate = mesh.get_coordinate()
    # a dimension splits unless it replicates (Shard, and FSDP-over-TP's _StridedShard, which
    # is no Shard subclass)
    return all(not p.is_replicate() or coordinate[i] == 0 for i, p in enumerate(placements))
