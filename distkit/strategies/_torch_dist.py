"""torch.distributed helpers shared by the strategies built on it (ddp, apex).

Plain functions rather than an intermediate class, so that every strategy stays one level
below :class:`~distkit.strategies.base.Strategy`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from distkit.errors import ConfigurationError, LauncherMismatchError
from distkit.faults._channel import SideChannel
from distkit.launch._env import LaunchEnv
from distkit.launch._registry_view import auto_strategy_name
from distkit.strategies._collectives import PendingSum
from distkit.strategies.base import Topology, TrainOptions
from distkit.strategies.syncbn import convert_to_global_batchnorm, convert_to_masked_sync_batchnorm


def init_process_group(
    env: LaunchEnv, *, backend: str | None, timeout: timedelta, strategy: str
) -> tuple[Topology, bool]:
    """Join (or create) the default process group; returns the topology and whether we own it.

    A group the user already created is reused and left alone at teardown. Without a launcher a
    world of one is formed on an in-process store, so the same code runs under ``python``.
    """
    if env.launcher == "horovodrun":
        raise LauncherMismatchError(
            f"strategy={strategy!r} runs under torchrun (or python -m torch.distributed.launch), "
            f"but this process was started by {env.launcher}. Either launch with "
            f"`torchrun --nproc_per_node N script.py`, or keep {env.launcher} and use "
            f"strategy={auto_strategy_name(env)!r}."
        )
    use_cuda = torch.cuda.is_available()
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = env.local_rank if env.is_torch_launcher else rank
        return _topology(rank, local_rank, world_size, use_cuda, strategy), False
    chosen = backend or ("nccl" if use_cuda else "gloo")
    if chosen not in dist.Backend.backend_list and chosen not in ("nccl", "gloo", "mpi"):
        raise ConfigurationError(
            f"unknown torch.distributed backend {chosen!r}. Allowed: nccl (CUDA), gloo (CPU, "
            "CUDA), mpi; leave backend=None to pick nccl on CUDA and gloo on CPU"
        )
    topology = _topology(env.rank, env.local_rank, env.world_size, use_cuda, strategy)
    if topology.device.type == "cuda":
        torch.cuda.set_device(topology.device)
    if env.is_torch_launcher or (env.is_cluster_launcher and env.world_size > 1):
        if env.is_torch_launcher:
            _require_rendezvous_env(env)
        with _hint_while_waiting(env, timeout):
            store = (
                _attempt_store(timeout) if env.is_torch_launcher else _cluster_store(env, timeout)
            )
            dist.init_process_group(
                chosen, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
            )
    else:
        dist.init_process_group(
            chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return topology, True


DEFAULT_TIMEOUT = timedelta(minutes=30)


def as_timeout(value: timedelta | float | None) -> timedelta | None:
    """A strategy's ``timeout`` argument as a timedelta (None stays None), validated."""
    if value is None:
        return None
    timeout = value if isinstance(value, timedelta) else timedelta(seconds=value)
    if timeout.total_seconds() <= 0:
        raise ConfigurationError(f"timeout must be positive, got {value!r}")
    return timeout


def resolve_timeout(explicit: timedelta | None, trainer_seconds: float | None) -> timedelta:
    """The strategy's own timeout, else the Trainer's ``collective_timeout``, else 30 minutes."""
    from_trainer = None if trainer_seconds is None else timedelta(seconds=trainer_seconds)
    if explicit is not None and from_trainer is not None and explicit != from_trainer:
        raise ConfigurationError(
            f"the strategy was given timeout={explicit.total_seconds():g}s and the Trainer "
            f"collective_timeout={trainer_seconds:g}s; give it in one place only"
        )
    return explicit or from_trainer or DEFAULT_TIMEOUT


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The launcher's rendezvous store, scoped to this restart attempt and this process group.

    torchrun's agent keeps one store for the whole job, and torch names every new default
    group "0" again, so every group would write the same keys. Under ``--max-restarts`` the
    restarted workers would read the dead workers' addresses; and a second Trainer in the
    same worker (a sweep) would read the first group's, while a slower rank may still use
    them: "connectFullMesh failed", "Connection reset by peer", or a hang. So each group gets
    its own prefix, numbered by a per-rank counter kept in that store: every rank creates
    its groups in the same order, so the numbers agree, and a rank that races ahead to
    group n never touches a key a late rank still reads in group n - 1.

    Without torchrun's agent (MASTER_ADDR/PORT set by hand) rank 0 hosts the store, and it
    may go when rank 0 destroys its group, under a rank that already started the next one.
    """
    store, rank, _ = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return _next_group_scope(store, f"distkit/attempt_{attempt}", rank)


def _next_group_scope(store: dist.Store, scope: str, rank: int) -> dist.Store:
    """``store`` seen through the prefix of this rank's next process group under ``scope``:
    every rank creates its groups in the same order, so their counters agree."""
    group = store.add(f"{scope}/rank_{rank}/groups", 1)
    return dist.PrefixStore(f"{scope}/group_{group}", store)


def _cluster_store(env: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The rendezvous of an srun / mpirun job: a store that rank 0 hosts at the address and
    port :class:`~distkit.launch._env.LaunchEnv` read or derived (no agent runs beside the workers).

    Every group of the job gets its own prefix, numbered per rank, as in
    :func:`_attempt_store`.
    """
    assert env.master_addr is not None and env.master_port is not None
    try:
        store = _job_store(env.master_addr, env.master_port, env.world_size, env.rank, timeout)
    except (RuntimeError, OSError) as exc:
        raise LauncherMismatchError(
            f"rank {env.rank} of a {env.launcher} job could not meet the others at "
            f"{env.master_addr}:{env.master_port} ({type(exc).__name__}: {exc}). Check that "
            "every task was started by the same step (a `python` run straight from an sbatch "
            "script starts one task, not SLURM_NTASKS: use srun), that MASTER_ADDR names the "
            "first task's host and resolves on every node, and that MASTER_PORT is free "
            "(set it by hand if two jobs share a node)"
        ) from exc
    return _next_group_scope(store, "distkit", env.rank)


#: the job's store per (address, port, world size, rank): see :func:`_job_store`
_JOB_STORES: dict[tuple[str, int, int, int], dist.Store] = {}


def _job_store(addr: str, port: int, world_size: int, rank: int, timeout: timedelta) -> dist.Store:
    """One store per job and process, kept for the life of the process, as torchrun's agent
    keeps its store for the job's life.

    A store per process group would die with rank 0's group: a rank that already moved on to
    the next Trainer (a sweep) would meet rank 0's old store, then lose it, and hang. This
    cache is the only process-wide state distkit keeps; it holds what the launcher made. The
    first Trainer's timeout is the store's: a later Trainer with another one must not host a
    second store on the same port.
    """
    key = (addr, port, world_size, rank)
    if key not in _JOB_STORES:
        store = dist.TCPStore(
            addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        store.add(_JOINED, 1)
        if rank == 0:
            _wait_for_tasks(store, world_size, timeout)
        _JOB_STORES[key] = store
    return _JOB_STORES[key]


_JOINED = "distkit/joined"
#: seconds a rank waits at the rendezvous for the others before it says what may be wrong
#: (once; half the rendezvous time-out where that is shorter, so the hint comes before it)
JOIN_HINT_S = 30.0


def join_hint_after(timeout: timedelta) -> float:
    """Seconds a rank waits for the others at the rendezvous before it prints a hint."""
    return min(JOIN_HINT_S, timeout.total_seconds() / 2)


@contextlib.contextmanager
def _hint_while_waiting(env: LaunchEnv, timeout: timedelta) -> Iterator[None]:
    """Under srun / mpirun, a rank other than 0 that is still meeting the others after
    :func:`join_hint_after` says where it waits and for whom (rank 0 hosts the store and says
    it itself, counting who came). A timer thread: the rendezvous blocks in C++."""
    if not env.is_cluster_launcher or env.rank == 0:
        yield
        return
    after = join_hint_after(timeout)
    timer = threading.Timer(after, _print_wait_hint, args=(env, after, timeout))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _print_wait_hint(env: LaunchEnv, waited: float, timeout: timedelta) -> None:
    if env.launcher == "srun":
        check = "`sacct -j $SLURM_JOB_ID`, the step's output"
    else:
        check = "mpirun's -np and its output"
    print(
        f"distkit: rank {env.rank} of {env.world_size} ({env.launcher}) has waited {waited:.0f}s "
        f"at the rendezvous {env.master_addr}:{env.master_port} for ranks "
        f"0..{env.world_size - 1} (rank 0 hosts it). Check that every task started, rank 0 "
        f"above all ({check}), that MASTER_ADDR names rank 0's host and that MASTER_PORT is "
        "the same in every task. It fails after the rendezvous time-out "
        f"({timeout.total_seconds():g}s, the Trainer's collective_timeout).",
        file=sys.stderr,
        flush=True,
    )


def _wait_for_tasks(store: dist.Store, world_size: int, timeout: timedelta) -> None:
    """Rank 0 waits for every task to reach the store; after a while it says why that can
    hang (an sbatch script that runs python itself: its one process has SLURM_PROCID=0)."""
    start, hinted = time.monotonic(), False
    while (joined := store.add(_JOINED, 0)) < world_size:
        waited = time.monotonic() - start
        if waited > timeout.total_seconds():
            raise TimeoutError(
                f"only {joined} of {world_size} tasks reached the store in {waited:.0f}s"
            )
        if waited > join_hint_after(timeout) and not hinted:
            hinted = True
            print(
                f"distkit: rank 0 has waited {waited:.0f}s for {world_size - joined} of "
                f"{world_size} tasks. Under SLURM, start the tasks with srun (`srun python "
                "train.py`): a `python train.py` in an sbatch script is one process that SLURM "
                "still calls rank 0 of SLURM_NTASKS. Under mpirun, check -np.",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(0.05)


def _require_rendezvous_env(env: LaunchEnv) -> None:
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(key)]
    if missing:
        raise LauncherMismatchError(
            f"{env.launcher} set RANK/WORLD_SIZE but not {', '.join(missing)}; torch.distributed "
            "cannot rendezvous. Launch with `torchrun --nproc_per_node N script.py`, which sets "
            "them."
        )


def _topology(
    rank: int, local_rank: int, world_size: int, use_cuda: bool, strategy: str
) -> Topology:
    if use_cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigurationError(
                f"strategy={strategy!r}: local rank {local_rank} has no GPU of its own (this "
                f"node has {count}). Start at most {count} processes per node "
                f"(--nproc_per_node {count})."
            )
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return Topology(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


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
    backend: str | None
    timeout: timedelta | None
    rank: int
    world_size: int
    device: torch.device
    _owns_group: bool = False  # distkit created the default group (and destroys it)
    _host_group: Any = None  # a gloo group for host-side sums beside an nccl default group
    #: the last host-side sums, kept past their use (see :data:`KEEP_PENDING`)
    _recent_sums: tuple[_TorchPending, ...] = ()

    def _join_group(self) -> Topology:
        """Join (or create) the default group, with the resolved collective timeout."""
        topology, self._owns_group = init_process_group(
            LaunchEnv.detect(),
            backend=self.backend,
            timeout=resolve_timeout(self.timeout, self.options.collective_timeout),
            strategy=self.name,
        )
        return topology

    def _leave_group(self) -> None:
        """Destroy the default group if :meth:`_join_group` created it."""
        if self._host_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._host_group)
        self._host_group = None
        self._recent_sums = ()
        if self._owns_group:
            destroy_process_group()
            self._owns_group = False

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return all_reduce(tensor, op, self.world_size, self.device)

    def all_reduce_async(self, tensor: torch.Tensor, *, name: str) -> PendingSum:
        if tensor.device.type != "cpu" or self.world_size == 1:
            return super().all_reduce_async(tensor, name=name)  # type: ignore[misc]
        work = tensor.detach().clone()
        handle = dist.all_reduce(work, op=dist.ReduceOp.SUM, group=self._cpu_group(), async_op=True)
        pending = _TorchPending(handle, work)
        self._recent_sums = (*self._recent_sums[1 - KEEP_PENDING :], pending)
        return pending

    def _cpu_group(self) -> Any:
        """The default group where it is gloo; else a gloo group, made on first use (every
        rank makes its first host-side sum at the same point, so they create it together)."""
        if dist.get_backend() == "gloo":
            return None
        if self._host_group is None:
            self._host_group = dist.new_group(backend="gloo")
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


class _TorchPending:
    """An asynchronous all-reduce on a gloo group: done in gloo's threads, read on wait."""

    def __init__(self, handle: Any, tensor: torch.Tensor) -> None:
        self._handle, self._tensor = handle, tensor

    def wait(self) -> torch.Tensor:
        self._handle.wait()
        return self._tensor


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


def native_alternative() -> str:
    """The strategy ``"auto"`` picks under torchrun: what to suggest where a backend can't run."""
    return auto_strategy_name(LaunchEnv(launcher="torchrun"))


def destroy_process_group() -> None:
    """Destroy the default group if it still exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


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
