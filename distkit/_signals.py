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
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

EXIT_CODE = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived during ``fit`` (internal: distkit turns it into a public error)."""


@dataclass
class TermState:
    """What the handler saw, and whether the rank is already dealing with a failure."""

    grace: float
    received: bool = False
    handling: bool = False
    _timer: threading.Timer | None = field(default=None, repr=False)

    def on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if not self.handling:
            raise KeyboardInterrupt

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        first = not self.received
        self.received = True
        if first:
            self._timer = threading.Timer(self.grace, _exit_terminated, args=(self.grace,))
            self._timer.daemon = True
            self._timer.start()
        if not self.handling:
            raise Terminated(f"signal {signum}")


@contextlib.contextmanager
def terminate_as_exception(grace: float) -> Iterator[TermState]:
    """Install the handler for the block (a no-op outside the main thread)."""
    state = TermState(grace)
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = signal.signal(signal.SIGTERM, state.on_signal)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:  # a user's own handler stays
        signal.signal(signal.SIGINT, state.on_interrupt)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _exit_terminated(grace: float) -> None:
    print(f"distkit: SIGTERM received {grace:g}s ago; exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_CODE)
