"""Atomic files: written beside the target, flushed, fsynced, then renamed over it.

A crash at any point leaves the old file or the new one, never half a file. Temp files are named
``.<target name>.<random>.tmp``, so a folder's owner can recognise (and sweep) those a killed
writer left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class TempFile:
    """A new, empty file beside ``target``, open for writing.

    Created with ``os.open(..., 0o666)`` rather than ``tempfile.mkstemp`` (whose files are
    0600), so the kernel applies the umask as it does for ``open`` and ``torch.save``.
    """

    def __init__(self, target: Path) -> None:
        while True:
            self.path = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                continue
        # the file system's clock at the start of this write (a network file system's clock
        # can differ from this machine's)
        self.started_ns = os.fstat(self.fd).st_mtime_ns

    def publish(
        self,
        path: Path,
        write: Callable[[BinaryIO], object],
        check: Callable[[Path], None] | None = None,
    ) -> None:
        """``write`` the content, ``check`` the written file, rename it to ``path``.

        On any failure (``check`` raising included) the temp file is removed and ``path`` is
        left as it was.
        """
        try:
            with os.fdopen(self.fd, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            if check is not None:
                check(self.path)
            os.replace(self.path, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        fsync_dir(path.parent)


def write_text(text: str, path: Path) -> None:
    """Replace ``path`` with ``text`` atomically."""
    TempFile(path).publish(path, lambda handle: handle.write(text.encode()))


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def mtime_ns(path: Path) -> int:
    """Modification time in ns (0 for a file that is gone)."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
