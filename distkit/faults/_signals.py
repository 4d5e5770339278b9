"""SIGTERM and SIGINT during a multi-process ``fit``: exceptions, so handlers still run.

Launchers stop the other workers with SIGTERM once one worker exits (torchrun, horovodrun), and
schedulers use it to pre-empt jobs. Python's default SIGTERM kills at once: a peer of a failed
rank would die in the middle of its own ``except`` block. While a ``fit`` runs (and only from
the main thread, where Python lets a handler be installed), distkit's handler raises
:class:`Terminated` in the main thread instead, unless the rank is already handling a failure,
and a timer exits the process with status 143 ``grace`` seconds after the signal if it is
still running then (the launcher wants it gone; the handlers had that long). The previous
handler comes back when ``fit`` ends.

SIGINT keeps Python's behaviour (``KeyboardInterrupt``), except while the rank is already
handling a failure: torchrun forwards a second SIGINT to its workers after the terminal's,
and an exception raised in the middle of the failure handling would cut it short.

A Python-level handler runs only when the main thread comes back to the interpreter; a main
thread blocked in C++ (a collective's ``Work::wait``, a backward pass waiting for DDP's
all-reduce) never runs it. So the grace timer does not start in the handler: CPython's C-level
handler writes each signal's number to the "wakeup fd" the moment it arrives, whatever the main
thread does, and a small thread reading it (:class:`_SignalWatch`) starts the timer. If the
main thread has still not run the handler when the grace is over, the timer exits the process
with 143 (SIGTERM) or 130 (SIGINT) after ``on_blocked`` (which tells the peers). A SIGINT the
main thread did take is left to the exception, as before: no exit.

Signals that preempt (``preempt_signals``, see :mod:`distkit.faults._preempt`) get a handler
that only notes them, and no timer: the ranks stop at an agreed step and save, however long
a collective keeps a main thread (a peer's long save, a slow step); the scheduler's SIGKILL
ends a job that truly hangs. While a failure is being handled they are timed like SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from distkit.faults._last_resort import exit_now
from distkit.faults._preempt import Preemption

EXIT_CODE = 128 + signal.SIGTERM
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid (Linux)


class Terminated(BaseException):
    """SIGTERM arrived during ``fit`` (internal: distkit turns it into a public error)."""


@dataclass
class TermState:
    """What the signals did, and whether the rank is already dealing with a failure.

    Args:
        grace: seconds from a signal's arrival until the process exits (a SIGTERM always, a
            SIGINT only if the main thread never took it).
        on_blocked: called (from a timer thread, just before the exit) when the main thread
            has not run the handler within ``grace``: it was blocked outside Python all along.
    """

    grace: float
    on_blocked: Callable[[int], None] | None = None
    #: signals that preempt (they are noted and the fit stops at an agreed step) or None
    preempt: Preemption | None = None
    handling: bool = False
    interrupt_is_ours: bool = False  # a user's own SIGINT handler is left alone, timer too
    watching: bool = False  # a _SignalWatch reports each signal as it arrives
    _arrived: set[int] = field(default_factory=set, repr=False)
    _taken: set[int] = field(default_factory=set, repr=False)  # the main thread ran a handler
    _timers: dict[int, threading.Timer] = field(default_factory=dict, repr=False)
    _ended: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def received(self) -> bool:
        """A SIGTERM arrived (whether or not the main thread has run its handler yet)."""
        return signal.SIGTERM in self._arrived

    def on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._taken.add(signum)
        if not self.handling:
            raise KeyboardInterrupt

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._taken.add(signum)
        self.arrived(signum)  # in case no watch saw it (none could be installed)
        if not self.handling:
            raise Terminated(f"signal {signum}")

    def on_preempt(self, signum: int, frame: FrameType | None) -> None:
        """A preempting signal, in the main thread: noted; the fit stops at an agreed step."""
        self._taken.add(signum)
        if not self.watching:  # the watch notes each signal (once) as it arrives
            self.arrived(signum)

    def _preempts(self, signum: int) -> bool:
        return self.preempt is not None and signum in self.preempt.signals

    def arrived(self, signum: int) -> None:
        """A signal arrived: start its grace timer, once (from any thread)."""
        if signum == signal.SIGINT and not self.interrupt_is_ours:
            return
        preempts = self._preempts(signum)
        if preempts and not self.handling and self.preempt is not None:
            # no exit timer: the ranks stop at the agreed step and save, however long a
            # collective or a peer's save keeps this main thread; a hang is the scheduler's
            # to end (its SIGKILL follows the signal by its grace period)
            self.preempt.arrived(signum)
            with self._lock:
                self._arrived.add(signum)
            return
        if signum not in (signal.SIGTERM, signal.SIGINT) and not preempts:
            return
        with self._lock:
            self._arrived.add(signum)
            if signum in self._timers or (self._ended and signum == signal.SIGINT):
                return
            timer = threading.Timer(self.grace, self._expire, args=(signum,))
            timer.daemon = True
            self._timers[signum] = timer
            timer.start()

    def end(self) -> None:
        """``fit`` is over: a SIGINT's timer is cancelled (its exception is the user's now);
        a SIGTERM's keeps running, as documented."""
        with self._lock:
            self._ended = True
            timer = self._timers.pop(signal.SIGINT, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, signum: int) -> None:
        line = None  # on_blocked says what happened itself
        name = signal.Signals(signum).name
        if signum in self._taken:
            if signum == signal.SIGINT:
                return  # the main thread has the KeyboardInterrupt: today's behaviour
            line = f"distkit: {name} received {self.grace:g}s ago; exiting"
        elif self._ended or self.on_blocked is None:
            line = f"distkit: {name} received {self.grace:g}s ago; exiting"
        else:
            with contextlib.suppress(Exception):
                self.on_blocked(signum)
        exit_now(line, 128 + signum)


class _SignalWatch:
    """Reads the signal numbers that CPython's C-level handler writes to the wakeup fd.

    The fd is one end of a Unix datagram socket pair. On Linux the other end asks for each
    writer's credentials: a process forked during ``fit`` (a DataLoader worker) inherits the
    wakeup fd, and a signal sent to it alone must not count as this process's. Every byte is
    passed on to the wakeup fd that was set before (asyncio's, another library's), which is
    set again when the watch stops.
    """

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._pid = os.getpid()
        self._reader, self._writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._writer.setblocking(False)  # set_wakeup_fd requires it
        self._credentials = hasattr(socket, "SO_PASSCRED")
        if self._credentials:
            self._reader.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._previous = -1
        self._thread = threading.Thread(target=self._run, name="distkit-signals", daemon=True)

    def start(self) -> None:
        """Become the wakeup fd (main thread only) and start reading."""
        try:
            self._previous = signal.set_wakeup_fd(self._writer.fileno())
        except BaseException:
            self._reader.close()
            self._writer.close()
            raise
        self._thread.start()

    def stop(self) -> None:
        """Give the wakeup fd back, stop the thread and close the sockets."""
        current = signal.set_wakeup_fd(self._previous)
        if current != self._writer.fileno():
            signal.set_wakeup_fd(current)  # someone replaced ours during fit: theirs stays
        with contextlib.suppress(OSError):
            self._reader.shutdown(socket.SHUT_RD)  # wakes the reader: it reads b"" and ends
        self._thread.join(timeout=5.0)
        self._reader.close()
        self._writer.close()

    def _run(self) -> None:
        space = socket.CMSG_SPACE(_UCRED.size) if self._credentials else 0
        while True:
            try:
                data, ancillary, _, _ = self._reader.recvmsg(64, space)
            except OSError:
                return
            if not data:
                return  # stop() shut it down
            if self._previous != -1:
                with contextlib.suppress(OSError):
                    os.write(self._previous, data)
            if self._sender(ancillary) not in (None, self._pid):
                continue  # a forked child's signal, not ours
            for signum in data:
                self._on_signal(signum)

    @staticmethod
    def _sender(ancillary: list[tuple[int, int, bytes]]) -> int | None:
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                return int(_UCRED.unpack(payload[: _UCRED.size])[0])
        return None


@contextlib.contextmanager
def terminate_as_exception(
    grace: float,
    on_blocked: Callable[[int], None] | None = None,
    preempt: Preemption | None = None,
) -> Iterator[TermState]:
    """Install the handlers and the signal watch for the block (a no-op outside the main
    thread). ``preempt``'s signals get a handler that only notes them (SIGTERM among them
    then raises nothing); the handlers they had are kept in ``preempt.previous``."""
    state = TermState(grace, on_blocked, preempt)
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = signal.signal(signal.SIGTERM, state.on_signal)
    preempted: dict[int, Any] = {}
    if preempt is not None:
        for signum in preempt.signals:
            preempted[signum] = signal.signal(signum, state.on_preempt)
        if signal.SIGTERM in preempted:
            preempted[signal.SIGTERM] = previous  # the handler before distkit's
        preempt.previous.update(preempted)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:  # a user's own handler stays
        state.interrupt_is_ours = True
        signal.signal(signal.SIGINT, state.on_interrupt)
    watch: _SignalWatch | None = None
    try:
        watch = _SignalWatch(state.arrived)
        watch.start()
        state.watching = True
    except (OSError, ValueError):  # no wakeup fd: the handler starts the timer, as it can
        watch = None
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        for number, handler in preempted.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        state.end()
        if watch is not None:
            watch.stop()
