"""Run a function on N real processes joined by gloo on loopback (no mocking).

Ranks are forked from a multiprocessing fork server that has already imported torch and distkit:
a 2-rank run starts in well under a second, and no rank inherits threads or locks from the
calling process (a plain fork of a busy parent, such as a test runner, can deadlock). Each rank
gets the variables torchrun would set, so strategies see a real launcher, and the SIGINT
handler a torchrun worker starts with (Python's ``KeyboardInterrupt``). Per-rank functions
must be importable, module-level functions (or partials of them); arguments and results are
pickled.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from distkit.launch._spawn import torchrun_variables

#: what the fork server imports once, before it forks any rank
PRELOAD = ["torch", "distkit"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for one worker on a single node."""
    return torchrun_variables(rank, world_size, port, "distkit-tests")


def plain_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """No launcher variables: the process looks like a plain ``python script.py``."""
    return {}


def _agent_store(timeout: float) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(
        "127.0.0.1",
        0,  # any free port: no race with another run picking the same one
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    results: Any,
    rank: int,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    # the SIGINT a worker of torchrun starts with: its agent handles SIGINT itself, so its
    # workers start at the default (KeyboardInterrupt) even when torchrun was started with
    # SIGINT ignored. The fork server's children would otherwise take whatever the process
    # that first started the fork server had then (SIG_IGN under `nohup` or `cmd &`).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # plain pickle: torch's queue reducer would share tensors through file descriptors
        # that die with this process before the parent reads them
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    launcher_env: Callable[[int, int, int], dict[str, str]] = torchrun_env,
    agent_store: bool = False,
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` forked processes; returns the results in rank order.

    Args:
        fn: a module-level function (or a partial of one); it and ``args`` are pickled.
        world_size: how many processes.
        timeout: seconds within which every rank must finish; then all are killed.
        env: extra environment variables for every rank.
        launcher_env: ``(rank, world_size, port) -> variables`` the launcher would set
            (default: torchrun's; :func:`plain_env` for a plain ``python`` process).
        agent_store: host the rendezvous store in this process for the whole run, as
            torchrun's agent does, instead of in rank 0: then the ranks can create and
            destroy many process groups in turn, and rank 0 closing its group never takes
            the store away from a rank still joining it.

    Raises:
        AssertionError: a rank raised (the message holds its traceback), or the ranks did not
            all finish within ``timeout``.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    store = _agent_store(timeout) if agent_store else None
    port = free_port() if store is None else store.port
    extra = {} if store is None else {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    procs = []
    for rank in range(world_size):
        child_env = {**launcher_env(rank, world_size, port), **extra, **(env or {})}
        proc = ctx.Process(target=_child, args=(fn, args, child_env, results, rank), daemon=True)
        proc.start()
        procs.append(proc)
    collected: dict[int, Any] = {}
    failures: list[str] = []
    grace = 10.0  # for a rank that has reported to exit on its own
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                collected[rank] = pickle.loads(value)
            else:
                failures.append(f"--- rank {rank} raised:\n{value}")
    except queue.Empty:
        failures.append(f"timed out after {timeout}s; ranks done: {sorted(collected)}")
        grace = 0.0  # a stuck rank will not exit: waiting for it only adds to the time-out
    finally:
        for proc in procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        del store  # the ranks are gone: so may the store
    if failures:
        raise AssertionError("\n".join(failures))
    return [collected[rank] for rank in range(world_size)]


def in_plain_process(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in one plain CPU process (no launcher variables, no GPU): a promise's
    reference run, "one process at N times the batch"; its result, a dict."""
    results = run_on_ranks(
        fn, *args, world_size=1, launcher_env=plain_env, env={"CUDA_VISIBLE_DEVICES": ""}
    )
    return dict(results[0])
