"""torch.distributed collectives and DDP wrapping shared by the strategies built on it.

The process group itself is formed in :mod:`distkit.strategies._torch_group`.

Plain functions rather than an intermediate class, so that every strategy stays one level
below :class:`~distkit.strategies.base.Strategy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from distkit.faults._channel import SideChannel
from distkit.faults._last_resort import end_without_teardown
from distkit.launch import StrategyChoices
from distkit.launch._env import LaunchEnv
from distkit.strategies._collectives import PendingSum
from distkit.strategies._torch_group import (
    init_process_group,
    leave_process_group,
    resolve_timeout,
)
from distkit.strategies.base import Topology, TrainOptions
from distkit.strategies.syncbn import convert_to_global_batchnorm, convert_to_masked_sync_batchnorm


def wrap_ddp(
    model: nn.Module, device: torch.device, *, find_unused_parameters: bool, **kwargs: Any
) -> nn.Module:
    """``DistributedDataParallel`` on this rank's device (no device_ids on CPU).

    A model the user placed elsewhere (several GPUs, or one that is not this rank's) is
    wrapped without ``device_ids``, as torch requires for a multi-device module: its own
    forward moves the activations between its devices.
    """
    device_ids = ddp_device_ids([p.device for p in model.parameters()], device)
    return DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=find_unused_parameters, **kwargs
    )


def ddp_device_ids(
    parameter_devices: list[torch.device], device: torch.device
) -> list[int | None] | None:
    """DDP's ``device_ids``: this rank's GPU when every parameter is on it; None on the CPU
    and for a model the user placed on other or several devices."""
    if device.type == "cuda" and all(d == device for d in parameter_devices):
        return [device.index]
    return None


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """torch's SyncBatchNorm on CUDA; on CPU, where torch refuses it, GlobalBatchNorm over gloo.

    Both leave placeholder samples out of their statistics (see :mod:`distkit.strategies.syncbn`).
    """
    if device.type == "cuda":
        return convert_to_masked_sync_batchnorm(model)
    return convert_to_global_batchnorm(model, differentiable_all_reduce_sum)


#: host-side sums whose tensor and work objects are kept alive after their caller drops them.
#: A sum's last reference then goes on this thread, many sums later, never on gloo's. A gloo
#: thread freeing a Python-owned tensor must take the GIL (the likely cause, not proven), and
#: on CPython <= 3.11.7 a thread registering itself while DataLoader workers fork can leave a
#: worker deadlocked at start (python/cpython#112275). The stream feeds drop their last sum of
#: an epoch just before the validation loader forks; a rank hung there once in CI (faults.md).
KEEP_PENDING = 8


class TorchDistributedCollectives:
    """The process group and collectives of a strategy built on torch.distributed.

    Mixed into ddp, fsdp and apex, which set ``backend`` and ``timeout`` (their constructor
    arguments) and call :meth:`_join_group` / :meth:`_leave_group` from their set-up and
    teardown.
    """

    name: ClassVar[str]
    options: TrainOptions
    choices: StrategyChoices
    backend: str | None
    timeout: timedelta | None
    rank: int
    world_size: int
    device: torch.device
    _owns_group: bool = False  # holds a lease on distkit's default group (see _group_lease)
    _host_group: Any = None  # a gloo group for host-side sums beside an nccl default group
    #: the last host-side sums, kept past their use (see :data:`KEEP_PENDING`)
    _recent_sums: tuple[_TorchPending, ...] = ()

    def _join_group(self) -> Topology:
        """Join (or create) the default group, with the resolved collective timeout."""
        timeout = resolve_timeout(self.timeout, self.options.collective_timeout)
        topology, self._owns_group = init_process_group(
            LaunchEnv.detect(),
            backend=self.backend,
            timeout=timeout,
            strategy=self.name,
            choices=self.choices,
        )
        if topology.world_size > 1:  # every rank is here: the host-side sums' group now
            self._host_group = dist.new_group(backend="gloo", timeout=timeout)
        return topology

    def _leave_group(self, before_destroy: Callable[[], None] | None = None) -> bool:
        """Give back the lease :meth:`_join_group` took on distkit's default group; the last
        one destroys it (``before_destroy`` first). Whether it was destroyed."""
        if self._host_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._host_group)
        self._host_group = None
        self._recent_sums = ()
        if not self._owns_group:
            return False
        self._owns_group = False
        return leave_process_group(before_destroy=before_destroy)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return all_reduce(tensor, op, self.world_size, self.device)

    def all_reduce_async(self, tensor: torch.Tensor, *, name: str) -> PendingSum:
        if tensor.device.type != "cpu" or self.world_size == 1:
            return super().all_reduce_async(tensor, name=name)  # type: ignore[misc]
        work = tensor.detach().clone()
        group = self._cpu_group()
        handle = dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending = _TorchPending(handle, work, group)
        self._recent_sums = (*self._recent_sums[1 - KEEP_PENDING :], pending)
        return pending

    def _cpu_group(self) -> Any:
        """A gloo group of its own for host-side sums, beside the default group even where
        that is gloo: a sum some rank never joins (a rank-0-only ``rt.save`` while the
        others go on to their next backward) then waits instead of meeting the gradients'
        all-reduce, whose bytes gloo cannot take for the sum's (it aborted the process with
        ``gloo::EnforceNotMet``, no Python exception, no ``finally``); the waiting rank
        finds the others gone on (see runtime/_call_tags). Made on first use where
        :meth:`_join_group` did not make it (every rank makes its first host-side sum at
        the same point, so they create it together)."""
        if self._host_group is None:
            timeout = resolve_timeout(self.timeout, self.options.collective_timeout)
            self._host_group = dist.new_group(backend="gloo", timeout=timeout)
        return self._host_group

    def _broadcast(self, obj: Any, src: int) -> Any:
        return broadcast_object(obj, src, self.rank)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_gather(tensor, self.world_size, self.device)

    def _all_gather_object(self, obj: Any) -> list[Any]:
        return all_gather_object(obj, self.world_size)

    def barrier(self) -> None:
        dist.barrier()

    def side_channel(self) -> SideChannel | None:
        if not dist.is_initialized():
            return None
        return StoreChannel(dist.distributed_c10d._get_default_store())


#: host-side sums given up (see _TorchPending.abandon), and their groups
_ABANDONED: list[tuple[Any, Any, torch.Tensor]] = []


class _TorchPending:
    """An asynchronous all-reduce on a gloo group: done in gloo's threads, read on wait."""

    def __init__(self, handle: Any, tensor: torch.Tensor, group: Any) -> None:
        self._handle, self._tensor, self._group = handle, tensor, group

    def abandon(self) -> None:
        """Give up a sum some rank will never join: abort its group, whose teardown would
        otherwise wait for it (the failure's clean-up then never ends), and end the process
        at exit without the native teardown that still would (gloo cannot cancel the sum)."""
        with contextlib.suppress(Exception):
            self._group.abort()
        # held for the process's life: freeing the group would join its thread, which
        # waits in the sum (the freeing rank would hang where its frames are released)
        _ABANDONED.append((self._group, self._handle, self._tensor))
        end_without_teardown()

    def wait(self) -> torch.Tensor:
        self._handle.wait()
        return self._tensor

    def done(self) -> bool:
        return bool(self._handle.is_completed())


class StoreChannel:
    """:class:`~distkit.faults._channel.SideChannel` over the process group's rendezvous store."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None  # get() would block until the key appears
        return bytes(self._store.get(key)).decode()

    def set_first(self, key: str, value: str) -> str:
        return bytes(self._store.compare_set(key, "", value)).decode()

    def get_many(self, keys: list[str]) -> list[str | None]:
        return [self.get(key) for key in keys]


def all_reduce(
    tensor: torch.Tensor, op: str, world_size: int, device: torch.device
) -> torch.Tensor:
    """Sum or mean over ranks, out of place, returned on the input's device."""
    work = tensor.detach().to(device=device, copy=True)
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    if op == "mean":
        work /= world_size
    return work.to(tensor.device)


def broadcast_object(obj: Any, src: int, rank: int) -> Any:
    """``obj`` from rank ``src`` on every rank."""
    holder = [obj if rank == src else None]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather(tensor: torch.Tensor, world_size: int, device: torch.device) -> torch.Tensor:
    """Stack of every rank's tensor (same shape on every rank), on the input's device."""
    work = tensor.detach().to(device).contiguous()
    parts = [torch.empty_like(work) for _ in range(world_size)]
    dist.all_gather(parts, work)
    return torch.stack(parts).to(tensor.device)


def all_gather_object(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum over ranks is the sum of the ranks' gradients."""

    @override
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @override
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out


def differentiable_all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks whose backward also sums the gradients over ranks (for SyncBatchNorm)."""
    result: torch.Tensor = _AllReduceSum.apply(tensor)
    return result
