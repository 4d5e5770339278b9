"""The way out of a process that cannot end any other way: one line, then ``os._exit``.

A rank whose main thread is blocked outside Python (in a collective, in native code) runs no
``finally`` block and no exception handler; the watchdog, the signal timers and the failure
path's release timer end it from another thread. They all end it alike, here: the reason on
stderr, both streams flushed, then ``os._exit`` (no ``atexit``, no joining threads, which
would wait on the blocked one).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_now(line: str | None, code: int) -> NoReturn:
    """Say ``line`` on stderr (None: nothing more to say), flush, and end the process."""
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream must not keep the process alive
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def end_without_teardown() -> None:
    """End this process at interpreter exit without its native teardown, which would wait
    for ever: a collective that another rank will never join is still posted (a gloo group
    cannot cancel it). The other exit handlers run first (loggers flush, files close); then
    ``os._exit`` with the code Python would give (1 after an uncaught exception). The peers
    blocked on this process wake as its sockets close, instead of at their watchdog's
    ``fault_timeout``."""
    atexit.unregister(_end)
    atexit.register(_end)


def _end() -> None:
    atexit.unregister(_end)
    run_others = getattr(atexit, "_run_exitfuncs", None)
    if run_others is not None:
        with contextlib.suppress(Exception):
            run_others()
    exit_now(None, 1 if getattr(sys, "last_value", None) is not None else 0)
