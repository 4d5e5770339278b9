"""The way out of a process that cannot end any other way: one line, then ``os._exit``.

A rank whose main thread is blocked outside Python (in a collective, in native code) runs no
``finally`` block and no exception handler; the watchdog, the signal timers and the failure
path's release timer end it from another thread. They all end it alike, here: the reason on
stderr, both streams flushed, then ``os._exit`` (no ``atexit``, no joining threads, which
would wait on the blocked one).
"""

from __future__ import annotations

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
