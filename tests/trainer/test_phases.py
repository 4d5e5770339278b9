"""The step's phase seam: the watchdog's phase, the timer's marks and the profiler's ranges
move together, in the order a step passes through them."""

from __future__ import annotations

import torch

from distkit.faults._progress import Progress
from distkit.trainer._phases import Phases
from distkit.trainer.timing import StepTimer


class RecordingTimer(StepTimer):
    """The real timer, remembering the phase of each mark."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.marks: list[str] = []

    def mark(self, phase: str) -> None:
        self.marks.append(phase)
        super().mark(phase)


class RecordingRanges:
    def __init__(self) -> None:
        self.events: list[str] = []

    def begin(self, phase: str) -> None:
        self.events.append(f"+{phase}")

    def end(self) -> None:
        self.events.append("-")


def _one_window_of_two(phases: Phases, seen: list[str], progress: Progress) -> None:
    phases.enter("data")
    for last in (False, True):
        phases.enter("forward")
        seen.append(progress.phase)
        phases.enter("backward")
        seen.append(progress.phase)
        phases.leave()
        seen.append(progress.phase)  # the watchdog still reads backward
        if last:
            phases.enter("optimizer")
            seen.append(progress.phase)
            phases.leave()
            phases.leave("other")
        phases.enter("data")
    phases.close()


def test_phases_move_the_watchdog_the_timer_and_the_profiler_together():
    progress, timer, ranges = Progress(), RecordingTimer(), RecordingRanges()
    timer.start()
    seen: list[str] = []
    _one_window_of_two(Phases(progress, timer, ranges), seen, progress)
    assert seen == ["forward", "backward", "backward", "forward", "backward", "backward",
                    "optimizer"]  # fmt: skip
    # each mark names the phase the time since the last one was spent in
    assert timer.marks == ["data", "forward", "backward", "data", "forward", "backward",
                           "optimizer", "other"]  # fmt: skip
    assert ranges.events == ["+data", "+forward", "+backward", "-", "+data", "+forward",
                             "+backward", "-", "+optimizer", "-", "-", "+data", "-"]  # fmt: skip
    assert progress.phase == "data"


def test_phases_without_a_profiler_still_time_and_tell_the_watchdog():
    progress, timer = Progress(), RecordingTimer()
    timer.start()
    seen: list[str] = []
    _one_window_of_two(Phases(progress, timer, None), seen, progress)
    assert timer.marks[-2:] == ["optimizer", "other"] and seen[-1] == "optimizer"
