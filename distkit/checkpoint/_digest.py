"""Digests that let a checkpoint prove its bytes are the ones distkit wrote.

``torch.save`` writes a zip archive and checks nothing when loading: one flipped bit in a
tensor record loads as a wrong weight. distkit hashes the archive while ``torch.save`` writes
it and stores the SHA-256 in the archive's own comment field (the last bytes of a zip file,
which every zip reader skips, ``torch.load`` included). Verifying reads the file once more
and compares. Shards of a sharded checkpoint are hashed file by file, each by the rank that
wrote it; their digests travel inside the checkpoint file, under its digest.

The digest is of the archive as ``torch.save`` wrote it, with an empty comment: the file's
bytes up to the comment length field, then that field as zero.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from typing_extensions import override

ALGORITHM = "sha256"
#: the zip comment distkit writes: this marker, then the hex digest
MARKER = b"distkit-sha256:"
_HEX_LENGTH = 64
_COMMENT = len(MARKER) + _HEX_LENGTH
#: a zip archive's end-of-central-directory record: 22 bytes, then the comment
_EOCD = b"PK\x05\x06"
_EOCD_SIZE = 22
_CHUNK = 1 << 20


class DigestMismatch(Exception):
    """The bytes on disk are not the bytes that were hashed (raised with what differs)."""


class HashingWriter(io.RawIOBase):
    """A write-only file object that hashes what passes through it to ``handle`` (a new,
    empty file: what ``torch.save`` writes is appended in order, never sought)."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__()
        self.handle = handle
        self.hash = hashlib.new(ALGORITHM)
        self.size = 0
        self._tail = b""  # the last bytes written: the archive's end record, when complete
        #: the error a write met (torch.save reports it only as "unexpected pos")
        self.failure: OSError | None = None

    @override
    def writable(self) -> bool:
        return True

    @override
    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += len(view)
        self._tail = (self._tail + bytes(view[-_EOCD_SIZE:]))[-_EOCD_SIZE:]
        try:
            return self.handle.write(view)
        except OSError as exc:
            self.failure = exc
            raise

    @override
    def flush(self) -> None:
        self.handle.flush()

    def seal(self) -> None:
        """Append the digest of what was written (a complete zip archive) as its comment.

        Raises:
            ValueError: what was written does not end in an empty-comment zip record (not
                a ``torch.save`` archive), so no digest could be placed.
        """
        record = self._tail
        if not (record.startswith(_EOCD) and record.endswith(b"\x00\x00")):
            raise ValueError("the archive does not end in a zip record with an empty comment")
        comment = MARKER + self.hash.hexdigest().encode()
        self.handle.seek(self.size - 2)
        self.handle.write(len(comment).to_bytes(2, "little") + comment)


def stored(path: Path) -> str | None:
    """The hex digest in ``path``'s zip comment, or None when it carries none."""
    size = path.stat().st_size
    if size < _EOCD_SIZE + _COMMENT:
        return None
    with path.open("rb") as handle:
        handle.seek(size - _COMMENT - _EOCD_SIZE)
        tail = handle.read()
    record, comment = tail[:_EOCD_SIZE], tail[_EOCD_SIZE:]
    if not (record.startswith(_EOCD) and comment.startswith(MARKER)):
        return None
    if int.from_bytes(record[-2:], "little") != _COMMENT:
        return None
    return comment[len(MARKER) :].decode("ascii", errors="replace")


def verify(path: Path) -> bool:
    """Check ``path`` against the digest in its comment: True when it matches, False when
    the file carries no digest.

    Raises:
        DigestMismatch: the file's bytes differ from those that were hashed.
    """
    expected = stored(path)
    if expected is None:
        return False
    body = path.stat().st_size - _COMMENT - 2  # up to the comment length field
    digest = hashlib.new(ALGORITHM)
    with path.open("rb") as handle:
        remaining = body
        while remaining > 0:
            chunk = handle.read(min(_CHUNK, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
    digest.update(b"\x00\x00")
    actual = digest.hexdigest()
    if actual != expected:
        raise DigestMismatch(f"{ALGORITHM} {actual[:16]}..., written {expected[:16]}...")
    return True


def file_digest(path: Path) -> str:
    """The hex digest of a whole file."""
    digest = hashlib.new(ALGORITHM)
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: digest}`` of the files ``names`` in ``folder``."""
    return {name: file_digest(folder / name) for name in sorted(names)}


def check_files(folder: Path, expected: dict[str, str]) -> None:
    """Raise :class:`DigestMismatch` naming the first file in ``folder`` that is missing or
    differs from ``expected``."""
    for name, digest in sorted(expected.items()):
        path = folder / name
        if not path.is_file():
            raise DigestMismatch(f"{name} is missing")
        actual = file_digest(path)
        if actual != digest:
            raise DigestMismatch(f"{name}: {ALGORITHM} {actual[:16]}..., written {digest[:16]}...")
