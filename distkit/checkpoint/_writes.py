"""Writing a checkpoint file: atomically where it is local, staged and uploaded whole where it
is a URL, its digest sealed into it and checked to load weights-only before it is published.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch

from distkit._atomic import TempFile
from distkit.checkpoint import _digest, _layout, _storage
from distkit.errors import CheckpointError

RECORDS = _layout.RECORDS
INTEGRITY = _layout.INTEGRITY


def atomic_save(
    payload: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves either the old file or the new one.

    Temp file in the same folder, flushed and fsynced, renamed over the target, folder fsynced.
    The file's mode follows the umask, as with ``torch.save``. A URL (``s3://...``): the
    file is written and checked locally, then uploaded in one piece (see ``_storage``).
    """
    if _storage.is_url(path):
        _upload(payload, os.fspath(path), storage_options)
        return
    path = _storage.local_path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder; a checkpoint is a file: pass a file path such as "
            f"{path / 'model.pt'}"
        )
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        save_new(TempFile(path), path, payload)


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """OS errors of a write as a CheckpointError that names the file (nothing was replaced)."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the checkpoint {path} ({type(exc).__name__}: {exc.strerror or exc}"
            f"{_free_space(path.parent)}); the previous file, if any, is unchanged. Check that "
            "the folder is writable and the disk has room"
        ) from exc


def _free_space(folder: Path) -> str:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f"; {free / 1e9:.2f} GB free there"


def _upload(payload: Mapping[str, Any], url: str, options: Mapping[str, Any] | None) -> None:
    remote = _storage.Remote(url, options)
    if remote.isdir(url):
        raise CheckpointError(
            f"{url} is a folder; a checkpoint is a file: pass a path such as {url}/model.pt"
        )
    with _storage.staged(_storage.name_of(url)) as folder:
        local = folder / _storage.name_of(url)
        with writing(local):
            save_new(TempFile(local), local, payload)
        remote.put(local, url)


def save_new(tmp: TempFile, path: Path, payload: Mapping[str, Any]) -> None:
    def write(handle: BinaryIO) -> None:
        writer = _digest.HashingWriter(handle)
        try:
            # a raw binary stream: torch.save writes to it as to a file (typeshed: no IO[bytes])
            content = _layout.stored(payload)
            content[RECORDS] = {**content[RECORDS], INTEGRITY: _digest.ALGORITHM}
            torch.save(content, cast(IO[bytes], writer))
        except RuntimeError:
            if writer.failure is not None:  # a full disk: torch says "unexpected pos"
                raise writer.failure from None
            raise
        writer.seal()

    tmp.publish(path, write, require_weights_only)


def require_weights_only(path: Path) -> None:
    """Refuse to publish a file that ``load`` would refuse (checked before the rename)."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            "the checkpoint holds an object that cannot be loaded weights-only (only tensors, "
            "numbers, strings, lists and dicts can): store plain values in extra=... (e.g. "
            f"obj.state_dict()). Nothing was written. torch: {str(exc).splitlines()[0]}"
        ) from None
