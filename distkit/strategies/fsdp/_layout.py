"""The parallel layout of an FSDPStrategy: one DeviceMesh ``(pipeline, replicate, shard,
tensor)``.

Ranks are laid out row-major, the tensor-parallel dimension innermost (the ``T`` consecutive
ranks of one node split each layer; across them, the data-parallel ranks shard and
replicate) and the pipeline dimension outermost (each pipeline stage a block of
``replicate x shard x T`` consecutive ranks, the links between stages the slowest ones). The
ranks of one model copy (its stages, and in each the ``T`` ranks of a tensor-parallel group)
see the same samples: the data's rank is the rank's place in ``(replicate, shard)``, and only
the copy's first rank (pipeline and tensor coordinates 0) counts what it computed, where sums
over the world would count it once per rank of the copy (see ``Strategy.data_leader``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distkit.errors import ConfigurationError
from distkit.strategies.base import Topology

DIMS = ("pipeline", "replicate", "shard", "tensor")


@dataclass(frozen=True)
class Layout:
    """``pipeline x replicate x shard x tensor`` ranks; ``mesh`` is None in a layout
    without tensor or pipeline parallelism, where FSDP keeps the meshes it always had."""

    replicate: int
    shard: int
    tensor: int
    rank: int
    mesh: Any = None
    pipeline: int = 1

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage: ``replicate x shard x tensor``."""
        return self.replicate * self.shard * self.tensor

    @property
    def data_world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def data_rank(self) -> int:
        return self.data_rank_of(self.rank)

    def data_rank_of(self, rank: int) -> int:
        return rank % self.stage_size // self.tensor

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def pipeline_rank(self) -> int:
        return self.rank // self.stage_size

    @property
    def stage_root(self) -> int:
        """The first rank of this rank's pipeline stage (data and tensor coordinates 0)."""
        return self.pipeline_rank * self.stage_size

    def pipeline_peers(self) -> list[int]:
        """The ranks of this rank's pipeline group (its coordinates but the pipeline one)."""
        within = self.rank % self.stage_size
        return [p * self.stage_size + within for p in range(self.pipeline)]

    def dp_mesh(self) -> Any:
        """The (sub)mesh FSDP shards over: ``shard``, or ``(replicate, shard)`` under HSDP."""
        return self.mesh["replicate", "shard"] if self.replicate > 1 else self.mesh["shard"]

    def tp_mesh(self) -> Any:
        return self.mesh["tensor"]

    def pp_group(self) -> Any:
        """The process group of this rank's pipeline peers (P2P between stages)."""
        return self.mesh["pipeline"].get_group()

    def words(self) -> str:
        words = f"replicate={self.replicate} x shard={self.shard} x tensor={self.tensor}"
        return f"pipeline={self.pipeline} x {words}" if self.pipeline > 1 else words


def layout_for(topology: Topology, replicate: int, tensor: int, pipeline: int = 1) -> Layout:
    """The layout of ``topology``'s world, its mesh built where tensor or pipeline
    parallelism needs it (a collective: every rank builds the same mesh)."""
    world = topology.world_size
    fixed = replicate * tensor * pipeline
    if world % fixed:
        given = f"replicate={replicate}, tensor_parallel={tensor}"
        product = "replicate x tensor_parallel"
        if pipeline > 1:
            given, product = (
                f"pipeline_parallel={pipeline}, {given}",
                f"pipeline_parallel x {product}",
            )
        raise ConfigurationError(
            f"FSDPStrategy({given}) needs a world size that is a multiple of {product} = "
            f"{fixed}; this job has {world} ranks. Choose degrees whose product divides "
            f"{world}, or launch a multiple of {fixed} ranks"
        )
    shard = world // fixed
    if tensor == 1 and pipeline == 1:
        return Layout(replicate, shard, 1, topology.rank)
    from torch.distributed.device_mesh import init_device_mesh

    shape = (pipeline, replicate, shard, tensor)
    mesh = init_device_mesh(topology.device.type, shape, mesh_dim_names=DIMS)
    return Layout(replicate, shard, tensor, topology.rank, mesh, pipeline)


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
    reads the mesh's rank table, a tensor, which a step should not (no host reads per step).
    ``root``: the first rank of this rank's pipeline stage (0 without a pipeline), whose
    copies count: each stage holds parameters of its own."""

    def __init__(self, rank: int, root: int = 0) -> None:
        self.rank = rank
        self.root = root
        #: (id of the mesh, placements) -> (the mesh, kept so that its id is not reused, answer)
        self._known: dict[tuple[int, tuple[Any, ...]], tuple[Any, bool]] = {}

    def __call__(self, value: torch.Tensor) -> bool:
        mesh = getattr(value, "device_mesh", None)
        if mesh is None:
            return self.rank == self.root
        key = (id(mesh), tuple(value.placements))  # type: ignore[attr-defined]
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = (mesh, counted_once(value, self.rank, self.root))
        return known[1]


def counted_once(value: torch.Tensor, rank: int, root: int = 0) -> bool:
    """Whether this rank's part of ``value`` (a gradient) is the one copy a sum over the
    world counts: every rank holds some form of every parameter, and the copies of one
    part sit on the ranks that differ only in a mesh dimension that does not split it (a
    ``Replicate`` dimension of its DTensor mesh, or a dimension outside that mesh: a norm
    sharded over ``shard`` alone is copied over ``tensor``). The copy counted is the one on
    the mesh through rank 0, at coordinate 0 of every replicating dimension. A plain tensor is
    whole on every rank: rank 0's counts. Under a pipeline, ``root`` (the first rank of this
    rank's stage) stands for rank 0: each stage's parameters are its own."""
    mesh = getattr(value, "device_mesh", None)
    if mesh is None:
        return rank == root
    placements = value.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):  # reduce_partial_gradients first
        raise ConfigurationError(
            f"a gradient is a partial sum (placements {tuple(placements)}) when its norm is "
            "taken: distkit sums such gradients before clipping; this one was left partial"
        )
    if not bool((mesh.mesh == root).any()):
        return False
    coordinate = mesh.get_coordinate()
    # a dimension splits unless it replicates (Shard, and FSDP-over-TP's _StridedShard, which
    # is no Shard subclass)
    return all(not p.is_replicate() or coordinate[i] == 0 for i, p in enumerate(placements))
