"""A tracker's calls, bounded: each waited for at most a deadline, none once it is unavailable.

A tracker's client can hold training up for minutes on a service that is down, printing
nothing: MLflow retries a refused connection with urllib3's growing back-off (some 4 minutes
a call), and a sqlite database it cannot open for some 100 s, at every call. A
:class:`TrackerCalls` runs each call on a thread of its own (one call at a time, in order)
and waits for it at most ``timeout`` seconds. A call that cannot connect (a refused or
reset connection, a host that does not resolve, a network timeout), or that runs past its
deadline, makes the tracker *unavailable* until :meth:`TrackerCalls.reset` (the logger's
``finalize``): that call and every later one raise :class:`TrackerUnavailableError`, the
later ones at once. The trainer reports a logger's error once per kind and trains on, so a
tracker that is down costs a fit one bounded wait.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar

from distkit.errors import DistkitError

T = TypeVar("T")


class TrackerUnavailableError(DistkitError, ConnectionError):
    """A logger's tracker could not be reached, or did not answer in time: the logger sends
    it nothing more until its run ends (``finalize``); the message names the first failure."""


class _Call(Generic[T]):
    """One call, run on the tracker's thread; ``done`` is set when it returned or raised."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            self.error = exc
        finally:
            self.done.set()


def _serve(calls: queue.Queue[_Call[Any] | None]) -> None:
    while (call := calls.get()) is not None:
        call.run()


class TrackerCalls:
    """The calls of one logger to its tracker, each waited for at most ``timeout`` seconds.

    The thread starts at the first call and ends at :meth:`reset`, after the call it is in:
    a daemon thread, so a call still stuck in the tracker's client does not hold up the
    process's exit either.

    Args:
        tracker: who calls what, for the messages: ``"MLflowLogger(tracking_uri='...')"``.
        timeout: the longest one call may hold up the caller, in seconds.
        fix: what the user can do when the tracker is unavailable (a sentence, no full stop:
            the trainer's report goes on after it).
    """

    def __init__(self, tracker: str, timeout: float, fix: str) -> None:
        self.tracker = tracker
        self.timeout = timeout
        self.fix = fix
        self.unavailable: str | None = None  # why, since the call that found it
        self._calls: queue.Queue[_Call[Any] | None] | None = None
        self._last: _Call[Any] | None = None  # the call the thread has or had

    def run(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the tracker's thread: its result, or what it raised.

        Raises:
            TrackerUnavailableError: the tracker was found unavailable earlier (at once), or
                ``fn`` could not connect, or did not return within ``timeout`` seconds (it
                goes on in the background; nothing waits for it).
        """
        if self.unavailable is not None:
            raise TrackerUnavailableError(
                f"{self.tracker}: {what} not sent: the tracker is unavailable since "
                f"{self.unavailable}. {_UNTIL}"
            )
        deadline = time.monotonic() + self.timeout
        if self._calls is None:
            self._calls = queue.Queue(maxsize=2)  # the one call in flight, and reset's end
            name = f"distkit-{self.tracker.partition('(')[0]}"
            threading.Thread(target=_serve, args=(self._calls,), name=name, daemon=True).start()
        previous = self._last
        if previous is not None and not previous.done.wait(deadline - time.monotonic()):
            # the caller stopped waiting for it (Ctrl-C), and it has not returned since
            self._late(f"the call before {what} did not return")
        call = _Call(fn)
        self._last = call
        self._calls.put_nowait(call)  # room: the last call is done, so taken
        if not call.done.wait(max(0.0, deadline - time.monotonic())):
            self._late(f"{what} did not return within {self.timeout:g} s")
        if call.error is not None:
            if _cannot_connect(call.error):
                error = f"{type(call.error).__name__}: {call.error}"
                self.unavailable = f"{what} failed to connect ({error})"
                raise TrackerUnavailableError(
                    f"{self.tracker} could not reach its tracker in {what} ({error}). "
                    f"{_UNTIL}. {self.fix}"
                ) from call.error
            raise call.error
        return call.result  # type: ignore[return-value]  # fn returned: a T

    def reset(self) -> None:
        """End the thread (after the call it is in) and forget that the tracker was
        unavailable: the next call, e.g. of the next fit, tries it again."""
        if self._calls is not None:
            self._calls.put_nowait(None)  # room: at most the last call is still there
            self._calls = None
        self._last = None
        self.unavailable = None

    def _late(self, why: str) -> NoReturn:
        self.unavailable = why
        raise TrackerUnavailableError(
            f"{self.tracker}: {why}; it goes on in the background, unwaited. {_UNTIL}. {self.fix}"
        )


_UNTIL = (
    "The logger sends nothing more to it, and raises this at once, until its finalize (the "
    "end of the fit)"
)


def _cannot_connect(error: BaseException) -> bool:
    """Whether the network failed under ``error``: a refused or reset connection, a timeout, a
    host name that does not resolve, anywhere in its chain (MLflow wraps them in its own
    MlflowException, a sqlite error in SQLAlchemy's; an HTTP error status is not one)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
