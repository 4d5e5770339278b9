"""The files of a BestCheckpoint: named after their monitor's value, ranked in their folder.

The name is the only record of a file's score that costs nothing to read, so the folder's
files of one monitor are ranked by the value in their names (6 significant digits), by every
run alike: two runs that share a folder agree on which files are the best.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
#: a temp file untouched this long is no live write's (writers touch theirs continuously)
STALE_SECONDS = 600.0


@dataclass(frozen=True)
class BestFiles:
    """The ``best-<metric>=<value>-step-<step>.pt`` files of one monitor in ``folder``."""

    folder: Path
    metric: str  # the monitor's name, made safe for a file name
    mode: str  # "min" or "max": which end of the values is the best

    @classmethod
    def of(cls, folder: Path, monitor: str, mode: str) -> BestFiles:
        return cls(Path(folder), _UNSAFE.sub("_", monitor), mode)

    def name(self, value: float, step: int) -> str:
        """The file name for ``value`` at global step ``step``."""
        return f"best-{self.metric}={value:.6g}-step-{step:09d}.pt"

    def score(self, name: str) -> float | None:
        """The value in ``name``; None when ``name`` is no file of this monitor or its value
        is not a number (a file renamed by hand): such a file is never ranked or deleted."""
        found = re.fullmatch(rf"best-{re.escape(self.metric)}=(.+)-step-\d+\.pt", name)
        if found is None:
            return None
        try:
            value = float(found[1])
        except ValueError:
            return None
        return None if math.isnan(value) else value

    def on_disk(self) -> list[str]:
        """The names of this monitor's files in the folder, with a score (rank 0 reads)."""
        if not self.folder.is_dir():
            return []
        return [
            path.name
            for path in self.folder.iterdir()
            if path.is_file() and self.score(path.name) is not None
        ]

    def ranked(self, names: Iterable[str]) -> list[tuple[float, str]]:
        """``(value, name)`` of the files of this monitor among ``names``, best first; of
        equal values (in their names), the earlier step first."""
        scored = {(value, name) for name in names if (value := self.score(name)) is not None}
        sign = 1.0 if self.mode == "min" else -1.0
        return sorted(scored, key=lambda item: (sign * item[0], item[1]))

    def delete_stale_temp_files(self) -> None:
        """Remove the temp files of this monitor's saves that were killed mid-write.

        A save writes ``.<name>.<12 hex digits>.tmp`` and renames it; a killed one leaves it
        behind, as big as the model. A writer keeps its file's time fresh as it writes, so one
        untouched for ``STALE_SECONDS`` belongs to no live save, of this run or another.
        """
        pattern = re.compile(
            rf"\.best-{re.escape(self.metric)}=.+-step-\d+\.pt\.[0-9a-f]{{12}}\.tmp"
        )
        now = time.time()
        for path in self.folder.iterdir():
            if not pattern.fullmatch(path.name):
                continue
            with contextlib.suppress(FileNotFoundError):
                if now - path.stat().st_mtime > STALE_SECONDS:
                    path.unlink()

    def delete(self, names: Iterable[str]) -> None:
        """Remove these files (one another run removed already is no error)."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (self.folder / name).unlink()
