"""A local checkpoint folder: ``step-XXXXXXXXX.pt`` files, a ``latest`` pointer, the last K kept,
and the temp files of killed writes swept."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distkit._atomic import TempFile, mtime_ns, write_text
from distkit.checkpoint import _storage, _writes
from distkit.errors import CheckpointError

LATEST = "latest"
_PREFIX = "step-"
_STEP_FILE = re.compile(r"step-(\d+)\.pt")
# temp files of distkit._atomic.TempFile (and of tempfile.mkstemp, which earlier versions used)
_TEMP_FILE = re.compile(r"\.(step-\d+\.pt|latest|write-check)\.\w+\.tmp")


def step_of(path: Path | str) -> int | None:
    """The step number in a ``step-XXXXXXXXX.pt`` file name (None for any other name)."""
    name = path.name if isinstance(path, Path) else _storage.name_of(path)
    match = _STEP_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def name_for(global_step: int) -> str:
    """The file name of a checkpoint folder's checkpoint of ``global_step``."""
    return f"{_PREFIX}{global_step:09d}.pt"


class CheckpointFolder:
    """A folder of ``step-XXXXXXXXX.pt`` files with a ``latest`` pointer; keeps the last K.

    Args:
        folder: where checkpoints go (every rank must see it when resuming).
        keep_last: how many checkpoints to keep (older ones are deleted after a save).
    """

    #: fsspec options for a folder on a store (None: a local folder)
    storage_options: Mapping[str, Any] | None = None

    def __init__(self, folder: str | os.PathLike[str], keep_last: int = 3) -> None:
        self.folder = _storage.local_path(folder)
        self.keep_last = keep_last

    @property
    def where(self) -> str:
        """The folder, as messages name it."""
        return str(self.folder)

    def written_ns(self, path: Path | str) -> int:
        """When ``path`` (a checkpoint of this folder) was written, in ns (0: gone)."""
        return mtime_ns(Path(path))

    def path_for(self, global_step: int) -> Path | str:
        """Where the checkpoint of ``global_step`` goes (a URL for a folder on a store)."""
        return self.folder / name_for(global_step)

    def save(self, payload: Mapping[str, Any], global_step: int) -> Path | str:
        """Write the checkpoint of ``global_step``, point ``latest`` at it, prune the folder.

        Temp files that killed saves (or failed ``latest`` writes) left behind are removed
        too, so the folder holds at most ``keep_last`` checkpoints' worth of data.
        """
        path = self.folder / name_for(global_step)
        with _writes.writing(path):
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = TempFile(path)
            # only rank 0 writes here, one save at a time: a temp file older than this one is
            # left by a writer that is gone (removed first, in case the disk is full)
            self._remove_temp_files(older_than_ns=tmp.started_ns)
            _writes.save_new(tmp, path, payload)
        with _writes.writing(self.folder / LATEST):
            write_text(path.name + "\n", self.folder / LATEST)
        # by write time, not by step number: files a previous run left with higher step
        # numbers are older than the one just written, and go first
        others = sorted((p for p in self._files() if p != path), key=mtime_ns)
        for old in others[: max(0, len(others) - (self.keep_last - 1))]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        return path

    def _remove_temp_files(self, older_than_ns: int) -> None:
        for entry in self.folder.iterdir():
            if _TEMP_FILE.fullmatch(entry.name) and mtime_ns(entry) < older_than_ns:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    entry.unlink()

    def check_writable(self) -> None:
        """Raise :class:`CheckpointError` now if this process cannot write checkpoints here."""
        if self.folder.exists() and not self.folder.is_dir():
            reason = "it is a file, not a folder"
        else:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                probe = TempFile(self.folder / ".write-check")
                os.close(probe.fd)
                os.unlink(probe.path)
                return
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc.strerror or exc}"
        raise CheckpointError(
            f"cannot write checkpoints to {self.folder} ({reason}). Pass a checkpoint_dir that "
            "rank 0 can create and write: it writes every checkpoint"
        )

    def checkpoints(self) -> list[Path | str]:
        """Complete checkpoint files, in step order (the highest step last)."""
        return list(self._files())

    def _files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        found = [(step_of(p), p) for p in self.folder.glob(f"{_PREFIX}*.pt")]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None)]

    def latest(self) -> Path | str | None:
        """The checkpoint ``latest`` names, else the highest step, else ``None``.

        ``resume="auto"`` goes by step numbers (see ``distkit.trainer._resume``); this is for people
        and tools that follow the pointer.
        """
        pointer = self.folder / LATEST
        if pointer.is_file():
            named = self.folder / pointer.read_text().strip()
            if named.is_file():
                return named
        found = self._files()
        return found[-1] if found else None
