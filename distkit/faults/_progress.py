"""Where each rank is in training, and which rank holds the others up.

The training loop writes this rank's :class:`Progress` (plain attribute stores, no I/O); the
watchdog thread publishes it through the side channel every few seconds, and rank 0's
watchdog feeds every rank's published progress to a :class:`HangDetector`. A rank whose
progress has not changed for ``hang_warning`` seconds while another rank is further on is
the one the others wait for in the next collective: it is named, once per stall.
"""

from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import dataclass, field

# Order within one optimizer step; "checkpoint" runs between steps (after step k is counted,
# before step k+1 fetches data) and "validation" after the epoch's last step.
PHASE_ORDER = {
    "setup": -2,
    "checkpoint": -1,
    "data": 0,
    "forward": 1,
    "backward": 2,
    "optimizer": 3,
    "validation": 4,
}


@dataclass
class Progress:
    """This rank's position: epoch, optimizer steps taken, and the phase it is in."""

    epoch: int = 0
    step: int = 0
    phase: str = "setup"

    def encode(self) -> str:
        return f"{self.epoch}:{self.step}:{self.phase}"


@dataclass(frozen=True)
class Position:
    """A decoded :class:`Progress`, comparable: later in training is greater."""

    epoch: int
    step: int
    phase: str

    @classmethod
    def decode(cls, text: str) -> Position | None:
        parts = text.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return cls(int(parts[0]), int(parts[1]), parts[2])

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.epoch, self.step, PHASE_ORDER.get(self.phase, 0))

    def describe(self) -> str:
        where = f"epoch {self.epoch + 1}"
        if self.phase == "checkpoint":
            return f"{where}, saving a checkpoint after step {self.step}"
        if self.phase in ("setup", "validation"):
            return f"{where}, {self.phase}"
        return f"{where}, step {self.step + 1} ({self.phase})"


@dataclass(frozen=True)
class Stall:
    """A rank that has not moved for ``seconds`` while ``ahead`` (another rank) is further on."""

    rank: int
    text: str  # the stuck rank's published progress
    position: Position
    seconds: float
    ahead: Position


@dataclass
class HangDetector:
    """Finds ranks stuck behind the others from timed observations of every rank's progress.

    Args:
        threshold: seconds without progress before a rank counts as stuck.
    """

    threshold: float
    _seen: dict[int, tuple[str, float]] = field(default_factory=dict)
    _reported: dict[int, str] = field(default_factory=dict)
    #: since when each rank has been seen behind another at the progress it still shows
    _behind: dict[int, tuple[str, float]] = field(default_factory=dict)

    def observe(self, now: float, published: list[str | None]) -> list[Stall]:
        """Record every rank's published progress at time ``now``; returns new stalls."""
        positions: dict[int, Position] = {}
        for rank, text in enumerate(published):
            if text is None:
                continue
            previous = self._seen.get(rank)
            if previous is None or previous[0] != text:
                self._seen[rank] = (text, now)
                self._reported.pop(rank, None)
            position = Position.decode(text)
            if position is not None:
                positions[rank] = position
        if len(positions) < 2:
            return []
        furthest = max(positions.values(), key=lambda p: p.key)
        stalls = []
        for rank, position in positions.items():
            text, since = self._seen[rank]
            if position.key >= furthest.key:
                self._behind.pop(rank, None)
                continue
            if self._behind.get(rank, ("",))[0] != text:
                self._behind[rank] = (text, now)
            # behind for a while, not just now: a rank that waited in a collective for a
            # stalled peer shows its old place for a moment after the peer has moved on
            # past it (its main thread not yet scheduled), and is not the one stuck
            behind_for = now - self._behind[rank][1]
            if (
                now - since >= self.threshold
                and behind_for >= self.threshold / 2
                and self._reported.get(rank) != text
            ):
                self._reported[rank] = text  # once per stall
                stalls.append(Stall(rank, text, position, now - since, furthest))
        return stalls


def main_thread_stack(limit: int = 12) -> str:
    """The main thread's Python stack, innermost last (from any thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "(no main thread)"
    return "".join(traceback.format_stack(frame)[-limit:])


def describe_stall(stall: Stall, stack: str | None) -> str:
    """The one warning line (and the stuck rank's stack, if it could be had)."""
    line = (
        f"distkit: rank {stall.rank} has made no progress for {stall.seconds:.0f}s: it is in "
        f"{stall.position.describe()}, while another rank is in {stall.ahead.describe()} and "
        "waits for it in the next collective (this is a warning; the collective timeout still "
        "applies)"
    )
    if stack:
        indented = "".join(f"    {row}\n" for row in stack.rstrip("\n").splitlines())
        line += f"\n  rank {stall.rank}'s main thread:\n{indented}"
    return line.rstrip("\n")
