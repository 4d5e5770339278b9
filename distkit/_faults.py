"""When one rank fails, every rank stops soon, and the failing rank's error is shown once.

Without this, a rank that raises leaves the others blocked in a collective until its timeout
(30 minutes by default). During ``fit`` on more than one process:

* the rank that raises prints its traceback, tells its peers through the strategy (for
  torch.distributed, a key in the rendezvous store) and exits with status 1 at once, skipping
  teardown that could block on the dead collective. Launchers (torchrun, horovodrun, mpirun)
  then stop the other workers, or restart the group under ``torchrun --max-restarts``;
* a watchdog thread on every rank polls for such a notice and exits its rank within
  ``fault_timeout`` seconds, which covers launchers that do not stop the others.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distkit.strategies.base import Strategy

EXIT_CODE = 1


@contextlib.contextmanager
def fail_fast(strategy: Strategy, fault_timeout: float | None) -> Iterator[None]:
    """Run the block; on an exception in a multi-process run, stop every rank promptly."""
    if fault_timeout is None or strategy.world_size == 1:
        yield
        return
    stop = threading.Event()
    watchdog = threading.Thread(
        target=_watch, args=(strategy, stop, max(0.2, fault_timeout / 4)), daemon=True
    )
    watchdog.start()
    try:
        yield
    except BaseException as exc:
        stop.set()
        _die(strategy, exc)
    finally:
        stop.set()
        # the watchdog must be out of the store before anyone can destroy the process group
        # (a store call racing with teardown aborts the process)
        watchdog.join()


def _die(strategy: Strategy, exc: BaseException) -> None:
    rank = strategy.rank
    earlier = strategy.peer_failure()
    if earlier is None and strategy.is_peer_loss(exc):
        earlier = f"another rank stopped ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    if earlier is not None:  # a consequence of another rank's failure: say so in one line
        print(f"distkit: rank {rank} stopping: {earlier}", file=sys.stderr, flush=True)
    else:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(f"distkit: rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        summary = f"rank {rank} failed with {type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            strategy.announce_failure(summary)
    sys.stdout.flush()
    os._exit(EXIT_CODE)  # teardown could block on the collective the peers abandoned


def _watch(strategy: Strategy, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        try:
            notice = strategy.peer_failure()
        except Exception:
            # the store went away: its host may have died (then our next collective fails
            # and we stop through the except path) or just finished first: never guess
            return
        if notice is not None and not stop.is_set():
            print(
                f"distkit: rank {strategy.rank} stopping because {notice} (see its error above)",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(EXIT_CODE)
