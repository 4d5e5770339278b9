"""A Trainer's ``checkpoint_dir`` on an object store (``s3://bucket/run``, ``gs://...``).

The same folder as :class:`distkit.checkpoint.CheckpointFolder` keeps locally:
``step-XXXXXXXXX.pt`` objects, a ``latest`` pointer, the last K kept. A checkpoint object is
its own commit record: it is uploaded whole once written and verified on this machine (see
``_storage``), so it is in the listing complete or not at all; the pointer is written after
it, and older checkpoints are deleted only after that, so a writer killed at any moment
leaves the previous checkpoint the newest committed one.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from typing_extensions import override

from distkit.checkpoint import _storage, _writes
from distkit.checkpoint._folder import LATEST, CheckpointFolder, name_for, step_of
from distkit.errors import CheckpointError


class RemoteCheckpointFolder(CheckpointFolder):
    """A checkpoint folder at the URL ``url``; ``storage_options`` go to fsspec."""

    def __init__(
        self, url: str, keep_last: int = 3, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.remote = _storage.Remote(self.url, self.storage_options)

    @property
    @override
    def where(self) -> str:
        return self.url

    @property
    def folder(self) -> Path:  # type: ignore[override]
        raise CheckpointError(
            f"the checkpoint folder {self.url} is on a store, not on this machine: it has no "
            "local path. Use its checkpoints() and load them with distkit.checkpoint.load(url)"
        )

    @override
    def path_for(self, global_step: int) -> str:
        return _storage.join(self.url, name_for(global_step))

    @override
    def save(self, payload: Mapping[str, Any], global_step: int) -> str:
        url = self.path_for(global_step)
        _writes.atomic_save(payload, url, storage_options=self.storage_options)
        self.remote.write_text(_storage.join(self.url, LATEST), _storage.name_of(url) + "\n")
        others = sorted(
            (entry for entry in self._entries() if entry.name != _storage.name_of(url)),
            key=lambda entry: (entry.modified_ns, step_of(entry.name) or 0),
        )
        for old in others[: max(0, len(others) - (self.keep_last - 1))]:
            self.remote.remove(_storage.join(self.url, old.name))
        return url

    @override
    def check_writable(self) -> None:
        probe = _storage.join(self.url, f".write-check.{secrets.token_hex(6)}")
        try:
            self.remote.make_bucket()
            self.remote.write_text(probe, "distkit")
            self.remote.remove(probe)
        except (CheckpointError, OSError) as exc:
            raise CheckpointError(
                f"cannot write checkpoints to {self.url} ({exc}). Pass a checkpoint_dir that "
                "rank 0 can write: it writes every checkpoint"
            ) from None

    @override
    def checkpoints(self) -> list[Path | str]:
        found = sorted((step_of(entry.name), entry.name) for entry in self._entries())
        return [_storage.join(self.url, name) for _, name in found]

    @override
    def latest(self) -> str | None:
        named = self.remote.read_text(_storage.join(self.url, LATEST))
        found = self.checkpoints()  # one listing, in step order
        if named is not None and _storage.join(self.url, named.strip()) in found:
            return _storage.join(self.url, named.strip())
        return str(found[-1]) if found else None

    @override
    def written_ns(self, path: Path | str) -> int:
        name = _storage.name_of(str(path))
        return next((e.modified_ns for e in self._entries() if e.name == name), 0)

    def _entries(self) -> list[_storage.Entry]:
        return [
            entry
            for entry in self.remote.listing(self.url)
            if not entry.is_dir and step_of(entry.name) is not None
        ]
