"""Run a function on N real processes joined by gloo on loopback (no mocking).

Ranks are forked from a multiprocessing fork server that has already imported torch and distkit:
a 2-rank test starts in well under a second, and no rank inherits threads or locks from the
pytest process (a plain fork of a busy parent can deadlock). Each rank gets the variables
torchrun would set, so strategies see a real launcher. Per-rank bodies must be importable,
module-level functions (or partials of them); arguments and results are pickled.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for one worker on a single node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "distkit-tests",
    }


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    results: Any,
    rank: int,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
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
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` forked processes; returns the results in rank order.

    Raises AssertionError with the failing rank's traceback if any rank raises, and kills
    every rank if they do not all finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "distkit", "tests.workloads"])
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        child_env = {**launcher_env(rank, world_size, port), **(env or {})}
        proc = ctx.Process(target=_child, args=(fn, args, child_env, results, rank), daemon=True)
        proc.start()
        procs.append(proc)
    collected: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                collected[rank] = pickle.loads(value)
            else:
                failures.append(f"--- rank {rank} raised:\n{value}")
    except queue.Empty:
        failures.append(f"timed out after {timeout}s; ranks done: {sorted(collected)}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [collected[rank] for rank in range(world_size)]
