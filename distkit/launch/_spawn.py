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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from typing_extensions import override

from distkit._validate import check_ints
from distkit.errors import (
    ConfigurationError,
    PeerFailureError,
    RankDisagreementError,
    TrainingInterrupted,
    WorkerError,
)

START_METHODS = ("fork", "spawn", "forkserver")
#: seconds a worker may take to exit after the caller is interrupted, before it is killed
EXIT_GRACE_S = 15.0
#: seconds the other workers have, after one reported an error, to finish or report theirs
#: before they are stopped: a worker that failed before it joined the others leaves them
#: waiting for it (up to the 30-minute rendezvous time-out), so nobody waits for them
STOP_AFTER_ERROR_S = 3.0
#: errors that only report another worker's failure (a peer that left or hung, ranks that
#: could not meet, the stop sent to them): raised only when no real error came
FOLLOW_ON_ERRORS: tuple[type[BaseException], ...] = (
    PeerFailureError,
    RankDisagreementError,
    TrainingInterrupted,
)


class RemoteTraceback(Exception):
    """The worker's traceback, chained as the ``__cause__`` of its re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    @override
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

    Once a worker has failed, the others get ``STOP_AFTER_ERROR_S`` (3 s) to finish or
    report, then they are stopped (SIGTERM, then SIGKILL), so a failure ends the call within
    seconds even when the others were waiting for the failed one.

    Raises:
        Exception: the first real worker error (not a follow-on such as a peer's
            ``PeerFailureError`` or ``RankDisagreementError``), as its own type, with the
            worker's traceback chained as its cause and one note per other worker that
            failed or was stopped.
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
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30)
    )
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


@dataclass(frozen=True)
class _Failure:
    """A worker's error as it arrived (or its silent death), in the order they came."""

    rank: int
    name: str
    text: str
    trace: str | None  # None: it died without a word
    payload: bytes | None  # the pickled exception, where it survives a round trip
    #: it only reports another rank's failure (see :data:`FOLLOW_ON_ERRORS`)
    follow_on: bool = False

    @classmethod
    def reported(cls, rank: int, report: tuple[str, str, str, bytes | None]) -> _Failure:
        name, text, trace, payload = report
        exc = None if payload is None else pickle.loads(payload)
        return cls(rank, name, text, trace, payload, isinstance(exc, FOLLOW_ON_ERRORS))

    @classmethod
    def silent_death(cls, rank: int, exitcode: int) -> _Failure:
        return cls(
            rank,
            "WorkerError",
            f"worker {rank} died with exit code {exitcode} without reporting (killed, out of "
            "memory, or os._exit)",
            None,
            None,
        )

    def summary(self) -> str:
        first = self.text.strip().splitlines()[0] if self.text.strip() else ""
        return f"{self.name}: {first[:300]}" if first else self.name


def _collect(results: Any, workers: list[Any], timeout: float | None) -> Any:
    deadline = None if timeout is None else time.monotonic() + timeout
    done: set[int] = set()
    value: Any = None
    failures: list[_Failure] = []
    stop_at: float | None = None  # the end of the others' grace, from the first failure
    while len(done) < len(workers):
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            break
        if deadline is not None and now > deadline and not failures:
            raise WorkerError(
                f"the workers did not finish within timeout={timeout:g}s (done: "
                f"{sorted(done) or 'none'}); they are stopped"
            )
        # dead before the wait: a worker flushes its queue before it exits, so a report of
        # theirs is in the queue before the wait begins, and an empty wait means none came
        dead = [r for r, w in enumerate(workers) if r not in done and w.exitcode is not None]
        try:
            rank, kind, payload = results.get(timeout=1.0 if stop_at is None else stop_at - now)
        except queue.Empty:
            for rank in dead:
                done.add(rank)
                failures.append(_Failure.silent_death(rank, workers[rank].exitcode))
        else:
            done.add(rank)
            if kind == "ok" and rank == 0:
                value = pickle.loads(payload)
            elif kind == "error":
                failures.append(_Failure.reported(rank, payload))
        if failures and stop_at is None:
            stop_at = time.monotonic() + STOP_AFTER_ERROR_S
    if failures:
        raise _first_error(failures, [rank for rank in range(len(workers)) if rank not in done])
    return value


def _first_error(failures: list[_Failure], running: list[int]) -> BaseException:
    """The first failure that is not a follow-on of another (else the first), as itself,
    with the worker's traceback as its cause and the other workers' fates as notes."""
    first = next((f for f in failures if not f.follow_on), failures[0])
    if first.payload is not None:
        exc: BaseException = pickle.loads(first.payload)
    elif first.trace is None:  # a silent death
        exc = WorkerError(first.text)
    else:
        exc = WorkerError(f"worker {first.rank} raised {first.name}: {first.text}")
    if first.trace is not None:
        exc.__cause__ = RemoteTraceback(f"\n--- worker {first.rank} ---\n{first.trace}")
    for other in failures:
        if other is not first:
            exc.add_note(f"distkit.spawn: worker {other.rank} failed too: {other.summary()}")
    if running:
        exc.add_note(
            f"distkit.spawn: {_ranks(running)}, still running {STOP_AFTER_ERROR_S:g}s after the "
            f"first error, {'was' if len(running) == 1 else 'were'} stopped"
        )
    return exc


def _ranks(ranks: list[int]) -> str:
    return f"worker {ranks[0]}" if len(ranks) == 1 else f"workers {', '.join(map(str, ranks))}"


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
