"""What a user's script meets at its top level: a guard without a with-block, and refusals
said in one line.

:class:`ScriptGuard` (``rt.guard_script()``) gives a flat script, one with no ``main()`` to
indent under ``with rt:``, the block's fail-fast guard for the rest of the process: the guard
is entered at once; an exception the script does not catch reaches ``sys.excepthook``, which
runs the block's exit with it first (the peers are told, the Runtime closes), then prints as
Python would; a script that ends (or calls ``sys.exit``) leaves the block as its end would,
from ``atexit``. Ctrl-C and SIGTERM end the job with the block's one line and its status
(130, 143).

:func:`brief_if_uncaught` makes a refusal from the Runtime's start (strategy='apex' on a
machine without CUDA, a launcher's variables that do not add up) print one line instead of a
traceback from every rank, if the script does not catch it: each rank raises the same error
at the same line, and its frames are distkit's own. An error decided by the configuration
and the machine (a :class:`~distkit.errors.ConfigurationError` or
:class:`~distkit.errors.UnsupportedFeatureError`) is said once per machine, by the first of
the launch's processes there to raise it; any other is said by every rank, naming it. A
caught one changes nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from types import TracebackType
from typing import Any

from distkit.errors import ConfigurationError, DistkitError, UnsupportedFeatureError
from distkit.faults._last_resort import exit_now

Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RANKS = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


class ScriptGuard:
    """``with rt:`` for the rest of a script (see the module's docstring)."""

    def __init__(self, enter: Callable[[], object], leave: Callable[[Any, Any, Any], None]) -> None:
        self._leave = leave
        self._previous: Hook | None = None
        enter()
        self._previous = sys.excepthook
        sys.excepthook = self._uncaught
        atexit.register(self._script_ended)

    @property
    def active(self) -> bool:
        return self._previous is not None

    def end(self, kind: Any = None, exc: Any = None, tb: Any = None) -> None:
        """Leave the block now (as ``with rt:``'s end would); raises what replaces ``exc``."""
        if self._previous is None:
            return
        if sys.excepthook == self._uncaught:  # unless somebody replaced it since
            sys.excepthook = self._previous
        self._previous = None
        atexit.unregister(self._script_ended)
        self._leave(kind, exc, tb)

    def _uncaught(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous = self._previous or sys.__excepthook__
        final: BaseException = exc
        try:
            self.end(kind, exc, tb)
        except BaseException as raised:  # the block's exit replaces or re-raises it
            final = raised
        if isinstance(final, SystemExit):  # Ctrl-C, SIGTERM: said in one line already
            _run_exit_handlers()
            exit_now(None, final.code if isinstance(final.code, int) else 1)
        previous(type(final), final, final.__traceback__)

    def _script_ended(self) -> None:
        self.end()


def _run_exit_handlers() -> None:
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        with contextlib.suppress(Exception):  # a handler's failure must not change the status
            run()


def brief_if_uncaught(error: DistkitError) -> None:
    """Print ``error`` in one line, if the script does not catch it (module docstring)."""
    previous = sys.excepthook
    # who it is, without keeping it (and its frames) alive: exceptions take no weak reference
    target = (id(error), type(error), str(error))

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if sys.excepthook == hook:
            sys.excepthook = previous
        if (id(exc), type(exc), str(exc)) != target:
            previous(kind, exc, tb)
            return
        alike = isinstance(exc, (ConfigurationError, UnsupportedFeatureError))
        if alike and not _first_to_say(str(exc)):
            return  # another process of this launch, on this machine, said it
        rank = _env_int(_RANKS)
        who = f"rank {rank}: " if rank and not alike else ""
        print(f"error: {who}{kind.__name__}: {exc}{_where(tb)}", file=sys.stderr, flush=True)

    sys.excepthook = hook


def _first_to_say(message: str) -> bool:
    """Whether this process is the first of its launch on this machine to say ``message``:
    the one that creates a marker file named by the launcher's process and the message
    (whichever rank gets there first: the launcher stops the others as the first exits)."""
    digest = hashlib.sha256(message.encode()).hexdigest()[:16]
    name = f"distkit-refusal-{os.getuid()}-{os.getppid()}-{digest}"
    try:
        os.close(os.open(os.path.join(tempfile.gettempdir(), name), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    except OSError:
        return True  # no marker to be had: better twice than never
    return True


def _where(tb: TracebackType | None) -> str:
    """`` (script.py, line 12)``: the last frame outside distkit, or nothing."""
    place = ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(_PACKAGE + os.sep):
            place = f" ({os.path.basename(filename)}, line {tb.tb_lineno})"
        tb = tb.tb_next
    return place


def _env_int(keys: tuple[str, ...]) -> int:
    for key in keys:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0
