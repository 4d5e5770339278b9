"""Forming and leaving torch.distributed's default process group, for ddp, fsdp and apex.

Under torchrun the launcher's rendezvous (``env://`` variables, a TCP store); under a
cluster launcher (SLURM, mpirun, a Kubeflow PyTorchJob's pods) a store of distkit's own at
rank 0's address, with a hint
while ranks wait for each other; under plain ``python`` a world of one on an in-process
store. The collective timeout is resolved here (the strategy's own, else the Trainer's, else
torch's 30 minutes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from distkit.errors import ConfigurationError, LauncherMismatchError
from distkit.launch import StrategyChoices
from distkit.launch._env import LaunchEnv
from distkit.strategies import _group_lease
from distkit.strategies.base import Topology


def init_process_group(
    env: LaunchEnv,
    *,
    backend: str | None,
    timeout: timedelta,
    strategy: str,
    choices: StrategyChoices,
) -> tuple[Topology, bool]:
    """Join (or create) the default process group; returns the topology and whether a lease
    on it was taken (give it back with :func:`leave_process_group`).

    A group distkit made for an earlier strategy in this process (a sweep) is joined, with
    this strategy's timeout; a group the user already created is reused and left alone at
    teardown. Without a launcher a world of one is formed on an in-process store, so the same
    code runs under ``python``.
    """
    if env.launcher == "horovodrun":
        raise LauncherMismatchError(
            f"strategy={strategy!r} runs under torchrun (or python -m torch.distributed.launch), "
            f"but this process was started by {env.launcher}. Either launch with "
            f"`torchrun --nproc_per_node N script.py`, or keep {env.launcher} and use "
            f"strategy={choices.auto_name(env)!r}."
        )
    use_cuda = torch.cuda.is_available()
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        own_local_rank = env.is_torch_launcher or env.launcher == "kubeflow"  # 0: one per pod
        local_rank = env.local_rank if own_local_rank else rank
        _check_backend(backend, strategy)
        topology = _topology(rank, local_rank, world_size, use_cuda, strategy)
        leased = _group_lease.join()
        if leased:  # distkit's own, made for an earlier strategy: this one's timeout now
            dist.distributed_c10d._set_pg_timeout(timeout)
        return topology, leased
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
    _group_lease.made(dist.get_world_size())
    return topology, True


def leave_process_group(*, before_destroy: Callable[[], None] | None = None) -> bool:
    """Give back the lease :func:`init_process_group` took; the last one destroys the group
    (see :mod:`distkit.strategies._group_lease`). Whether it was destroyed."""
    return _group_lease.release(before_destroy=before_destroy)


def _check_backend(backend: str | None, strategy: str) -> None:
    """A backend asked for by name must be the one the existing group runs."""
    if backend is None:
        return
    running = str(dist.get_backend())
    if backend.lower() not in running.lower().split(":") and backend.lower() != running.lower():
        raise ConfigurationError(
            f"strategy={strategy!r} was given backend={backend!r}, but this process already "
            f"has a process group on {running!r} (made by an earlier Trainer or Runtime, or by "
            "you), which it would join: one process has one default group. Give every "
            f"Trainer of the process the same backend (or backend=None to join {running!r}), "
            "or close the earlier ones first (close() or a with-block), which destroys "
            "distkit's group"
        )


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
        if env.launcher == "kubeflow":
            check = (
                "that the master pod is running (`kubectl get pods`), that MASTER_ADDR (the "
                "master's service) resolves in this pod and that MASTER_PORT is the port the "
                "master container declares"
            )
        else:
            check = (
                "that every task was started by the same step (a `python` run straight from an "
                "sbatch script starts one task, not SLURM_NTASKS: use srun), that MASTER_ADDR "
                "names the first task's host and resolves on every node, and that MASTER_PORT "
                "is free (set it by hand if two jobs share a node)"
            )
        raise LauncherMismatchError(
            f"rank {env.rank} of a {env.launcher} job could not meet the others at "
            f"{env.master_addr}:{env.master_port} ({type(exc).__name__}: {exc}). Check {check}"
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
    elif env.launcher == "kubeflow":
        check = "`kubectl get pods` and the master pod's log"
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
                "still calls rank 0 of SLURM_NTASKS. Under mpirun, check -np. Under Kubeflow, "
                "check that every worker pod was scheduled (`kubectl get pods`).",
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
