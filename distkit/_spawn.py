"""``distkit.spawn``: N workers on this machine from a notebook or a script, no launcher.

The caller hosts the rendezvous store, as torchrun's agent does, and gives each worker
torchrun's variables, so ``Trainer(strategy="auto")`` inside the workers picks the torch
launchers' strategy (ddp) and one device each where there are devices.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

from distkit._checks import check_ints
from distkit.errors import ConfigurationError, WorkerError

START_METHODS = ("fork", "spawn", "forkserver")
#: seconds a worker may take to exit after the caller is interrupted, before it is killed
EXIT_GRACE_S = 15.0


class RemoteTraceback(Exception):
    """The worker's traceback, chained as the ``__cause__`` of its re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def spawn(
    fn: Callable[..., Any],
    *,
    nprocs: int,
    args: tuple[Any, ...] = (),
    start_method: str | None = None,
    timeout: float | None = None,
) -> Any:
    """Run ``fn(*args)`` in ``nprocs`` worker processes joined as one job; rank 0's result.

    Build the :class:`~distkit.Trainer` inside ``fn`` (``strategy="auto"`` picks ddp). Each
    worker sees torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``), and takes GPU ``LOCAL_RANK`` where there are GPUs.

    Args:
        fn: what every worker runs; its return value on rank 0 is returned (picklable).
        nprocs: how many workers (>= 1).
        args: arguments for ``fn`` (picklable).
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``. Default: ``"fork"`` when
            ``fn`` lives in an interactive ``__main__`` (a notebook or REPL, which a fresh
            process cannot import), else ``"spawn"`` (a script needs the usual
            ``if __name__ == "__main__":`` guard, as with ``torch.multiprocessing.spawn``).
        timeout: seconds the workers may run in all (None: no limit); then they are killed.

    Raises:
        Exception: the first worker error (the one that is not a peer's report of it), as
            its own type, with the worker's traceback chained as its cause.
        WorkerError: a worker error that cannot travel as itself, or a worker that died
            without a word (killed, or ``os._exit``).
        ConfigurationError: bad arguments, or CUDA initialised here before a fork.
    """
    check_ints(nprocs=(nprocs, 1))
    if not callable(fn):
        raise ConfigurationError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise ConfigurationError(f"args must be a tuple, got {type(args).__name__}: (x,)")
    method = start_method or _default_start_method(fn)
    if method not in START_METHODS:
        raise ConfigurationError(f"start_method={method!r}; allowed: {', '.join(START_METHODS)}")
    _refuse_forking_cuda(method)
    import torch.distributed as dist

    ctx: Any = mp.get_context(method)
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(minutes=30))  # fmt: skip
    workers = [
        ctx.Process(
            target=_worker,
            args=(fn, args, _worker_env(rank, nprocs, store.port), results, rank),
            name=f"distkit-worker-{rank}",
        )
        for rank in range(nprocs)
    ]
    with _reaped(workers):
        for worker in workers:
            worker.start()
        return _collect(results, workers, timeout)


def _default_start_method(fn: Callable[..., Any]) -> str:
    main = sys.modules.get("__main__")
    interactive = getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__")
    return "fork" if interactive else "spawn"


def _refuse_forking_cuda(method: str) -> None:
    import torch

    if method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ConfigurationError(
            "CUDA was initialised in this process before distkit.spawn: forked workers cannot "
            "use it (CUDA does not survive fork). Restart the kernel and call distkit.spawn "
            "before anything touches the GPU (no .cuda(), no torch.cuda calls in the "
            "notebook first), or define fn in an importable module and pass "
            "start_method='spawn'."
        )


def torchrun_variables(rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun sets for one worker of a single-node job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
    }


def _worker_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        **torchrun_variables(rank, world_size, port, f"distkit-spawn-{port}"),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the caller hosts the store, as an agent
    }


def _worker(
    fn: Callable[..., Any], args: tuple[Any, ...], env: Mapping[str, str], results: Any, rank: int
) -> None:
    _die_with_parent()
    os.environ.update(env)
    try:
        value = fn(*args)
        results.put((rank, "ok", pickle.dumps(value) if rank == 0 else None))
    except BaseException as exc:
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)  # some exceptions pickle but do not unpickle
        except Exception:
            payload = None
        results.put((rank, "error", (type(exc).__name__, str(exc), text, payload)))


def _die_with_parent() -> None:
    """Linux: a SIGTERM when the caller dies, so that a killed notebook leaves no worker."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _collect(results: Any, workers: list[Any], timeout: float | None) -> Any:
    deadline = None if timeout is None else time.monotonic() + timeout
    done: set[int] = set()
    value: Any = None
    errors: list[tuple[int, tuple[str, str, str, bytes | None]]] = []
    while len(done) < len(workers):
        try:
            rank, kind, payload = results.get(timeout=1.0)
        except queue.Empty:
            _check_alive(workers, done, errors)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(
                    f"the workers did not finish within timeout={timeout:g}s (done: "
                    f"{sorted(done) or 'none'}); they are stopped"
                ) from None
            continue
        done.add(rank)
        if kind == "ok" and rank == 0:
            value = pickle.loads(payload)
        elif kind == "error":
            errors.append((rank, payload))
    if errors:
        raise _first_error(errors)
    return value


def _check_alive(workers: list[Any], done: set[int], errors: list[Any]) -> None:
    for rank, worker in enumerate(workers):
        if rank not in done and not worker.is_alive() and worker.exitcode is not None:
            raise WorkerError(
                f"worker {rank} died with exit code {worker.exitcode} without reporting "
                f"(killed, out of memory, or os._exit)"
                + (f"; worker {errors[0][0]} had raised first" if errors else "")
            )


def _first_error(errors: list[tuple[int, tuple[str, str, str, bytes | None]]]) -> BaseException:
    # a peer's PeerFailureError only reports the real error: raise the real one
    errors.sort(key=lambda item: (item[1][0] == "PeerFailureError", item[0]))
    rank, (name, text, trace, payload) = errors[0]
    cause = RemoteTraceback(f"\n--- worker {rank} ---\n{trace}")
    if payload is not None:
        exc: BaseException = pickle.loads(payload)
        exc.__cause__ = cause
        return exc
    error = WorkerError(f"worker {rank} raised {name}: {text}")
    error.__cause__ = cause
    return error


@contextlib.contextmanager
def _reaped(workers: list[Any]) -> Iterator[None]:
    """On the way out (done, a worker error, Ctrl-C): no worker outlives the call."""
    try:
        yield
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()  # SIGTERM: distkit's handlers stop training cleanly
        for worker in workers:
            if worker.pid is not None:
                worker.join(timeout=EXIT_GRACE_S)
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=5)
