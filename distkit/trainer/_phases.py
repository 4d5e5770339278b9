"""One seam for a step's phases: the watchdog's phase, the step timer and the profiler's range.

A step passes through ``data``, ``forward``, ``backward`` and (at a window's end)
``optimizer``. Three observers follow it: the watchdog reads the phase a stuck rank sits in
(:class:`~distkit.faults._progress.Progress`), the step timer adds the time since its last
mark to the phase it names (:class:`~distkit.trainer.timing.StepTimer`), and the profiler
opens a ``distkit/<phase>`` range (:class:`~distkit.runtime.ProfileRun`'s ranges, None when
no profiler runs). :meth:`Phases.enter` and :meth:`Phases.leave` move all three together, so
the step loop reads as the user's four steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from distkit.faults._progress import Progress
    from distkit.trainer.timing import StepTimer


class Ranges(Protocol):
    """The profiler's phase ranges (one open at a time)."""

    def begin(self, phase: str) -> None: ...
    def end(self) -> None: ...


class Phases:
    """The phase a step is in, told to the watchdog, the timer and the profiler at once."""

    __slots__ = ("_current", "_mark", "_progress", "_ranges")

    def __init__(self, progress: Progress, timer: StepTimer, ranges: Ranges | None) -> None:
        self._progress, self._ranges = progress, ranges
        self._mark = timer.mark  # bound once: called a few times per step
        self._current: str | None = None

    def enter(self, phase: str) -> None:
        """Start ``phase``: the time since the timer's last mark goes to the phase left (none
        after :meth:`leave`), the watchdog reads ``phase``, its profiler range opens."""
        if self._current is not None:
            self._mark(self._current)
        self._progress.phase = phase
        if self._ranges is not None:
            self._ranges.begin(phase)
        self._current = phase

    def leave(self, timed: str | None = None) -> None:
        """End the current phase's timing and range (the watchdog keeps reading it until the
        next :meth:`enter`); ``timed`` names the time since the last mark instead (the step's
        callbacks and checkpoints: ``"other"``)."""
        name = timed if timed is not None else self._current
        if name is not None:
            self._mark(name)
        if self._ranges is not None:
            self._ranges.end()
        self._current = None

    def close(self) -> None:
        """The epoch is over: close the open range, timing nothing more."""
        if self._ranges is not None:
            self._ranges.end()
        self._current = None
