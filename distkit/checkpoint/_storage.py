"""Where checkpoints and weights live: a local path as always, or an fsspec URL.

A URL (``s3://bucket/run``, ``gs://bucket/model``, any scheme fsspec knows) is written by
staging: the file is written and checked on this machine first, exactly as a local one is
(digest, weights-only), then uploaded in one piece. On an object store an upload is atomic
(a multi-part upload becomes visible only when it completes), so an object is either the
whole file or absent: a writer killed mid-upload leaves nothing behind. Reading downloads
the object to a local file and reads that, digest first, as locally.

Credentials and endpoints come from the filesystem's own configuration (for S3: the AWS
environment and config files, ``AWS_ENDPOINT_URL`` for S3-compatible stores) or from
``storage_options``, passed to fsspec as they are. The filesystems are optional extras:
``pip install 'distkit[s3]'`` (s3fs) or ``'distkit[gcs]'`` (gcsfs).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distkit.errors import CheckpointError, ConfigurationError

#: the extra that installs each scheme's filesystem
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_SCHEME = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL for fsspec (``file://`` URLs are local paths)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        return False
    match = _SCHEME.match(path)
    return match is not None and match["scheme"].lower() != "file"


def local_path(path: str | os.PathLike[str]) -> Path:
    """A local path (a ``file://`` URL as its path)."""
    text = os.fspath(path)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def join(url: str, name: str) -> str:
    """``name`` inside the folder ``url``."""
    return f"{url.rstrip('/')}/{name}"


def name_of(url: str) -> str:
    """The last part of ``url`` (its file name)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def parent_of(url: str) -> str:
    """The folder holding ``url``."""
    return url.rstrip("/").rsplit("/", 1)[0]


@dataclass(frozen=True)
class Entry:
    """One object in a listing: its name in the folder, size and modification time."""

    name: str
    size: int
    modified_ns: int
    is_dir: bool


class Remote:
    """The fsspec filesystem of one URL, and the few operations checkpoints need of it.

    Raises:
        ConfigurationError: the scheme's filesystem is not installed (naming the extra), or
            fsspec does not know the scheme.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.scheme = url.split("://", 1)[0].lower()
        self.fs = _filesystem(url, dict(storage_options or {}))

    def put(self, local: Path, url: str) -> None:
        """Upload ``local`` to ``url`` in one piece (the object appears complete, or not)."""
        with _io(url, "upload to"):
            self.fs.put_file(str(local), url)

    def get(self, url: str, local: Path) -> None:
        """Download ``url`` into the file ``local``."""
        with _io(url, "download"):
            self.fs.get_file(url, str(local))

    def write_text(self, url: str, text: str) -> None:
        with _io(url, "write"):
            self.fs.pipe_file(url, text.encode())

    def read_text(self, url: str) -> str | None:
        """The object's text, or None where there is none."""
        try:
            return bytes(self.fs.cat_file(url)).decode()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _error(url, "read", exc) from None

    def listing(self, url: str) -> list[Entry]:
        """The objects and folders directly in ``url`` (none where it does not exist), read
        afresh from the store (another process may have written since)."""
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(url)
        try:
            found = self.fs.ls(url, detail=True)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _error(url, "list", exc) from None
        return [_entry(info) for info in found]

    def exists(self, url: str) -> bool:
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(parent_of(url))
        with _io(url, "look up"):
            return bool(self.fs.exists(url))

    def isdir(self, url: str) -> bool:
        with _io(url, "look up"):
            return bool(self.fs.isdir(url))

    def remove(self, url: str, *, recursive: bool = False) -> None:
        """Delete ``url`` (a folder with ``recursive``); one already gone is no error."""
        with contextlib.suppress(FileNotFoundError), _io(url, "delete"):
            self.fs.rm(url, recursive=recursive)

    def make_bucket(self) -> None:
        """Create the URL's folder where the store needs that (a local fsspec filesystem);
        object stores need none (a bucket is made by its owner)."""
        with contextlib.suppress(OSError, NotImplementedError):
            self.fs.makedirs(self.url, exist_ok=True)


def _entry(info: Mapping[str, Any]) -> Entry:
    name = name_of(str(info["name"]))
    modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
    stamp = 0
    timestamp = getattr(modified, "timestamp", None)
    if callable(timestamp):
        stamp = int(timestamp() * 1e9)
    elif isinstance(modified, (int, float)):
        stamp = int(modified * 1e9)
    return Entry(name, int(info.get("size") or 0), stamp, info.get("type") == "directory")


def _filesystem(url: str, options: dict[str, Any]) -> Any:
    scheme = url.split("://", 1)[0].lower()
    extra = EXTRAS.get(scheme)
    install = (
        f"pip install 'distkit[{extra}]'"
        if extra
        else f"install the fsspec filesystem for {scheme}://"
    )
    try:
        import fsspec
    except ImportError:
        raise ConfigurationError(
            f"{url} is a {scheme}:// URL, and reading or writing one needs fsspec, which is "
            f"not installed: {install}"
        ) from None
    try:
        fs, _ = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise ConfigurationError(
            f"{url}: the filesystem for {scheme}:// is not installed ({exc}): {install}"
        ) from None
    except ValueError as exc:
        raise ConfigurationError(
            f"{url}: fsspec does not know the scheme {scheme}:// ({exc}). Pass a local path, "
            "or a URL of an installed fsspec filesystem (s3://, gs://, ...)"
        ) from None
    except TypeError as exc:
        raise ConfigurationError(
            f"{url}: storage_options={options!r} are not options of the {scheme}:// "
            f"filesystem ({exc})"
        ) from None
    return fs


@contextlib.contextmanager
def _io(url: str, action: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _error(url, action, exc) from None


def _error(url: str, action: str, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot {action} {url} ({type(exc).__name__}: {exc}). Check the store's credentials "
        "and endpoint (for S3: the AWS environment or config files, AWS_ENDPOINT_URL for an "
        "S3-compatible store, or storage_options=...) and that the bucket exists"
    )


# ---------------------------------------------------------------------- staging
def staging_folder() -> Path:
    """This machine's folder for files on their way to or from a store (swept of what
    processes that are gone left there)."""
    folder = Path(tempfile.gettempdir()) / f"distkit-staging-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    for entry in folder.iterdir():
        pid = entry.name.split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staged(name: str) -> Iterator[Path]:
    """A fresh local folder named for this process, removed afterwards; ``name`` goes into
    its name for people looking."""
    folder = staging_folder() / f"{os.getpid()}.{secrets.token_hex(4)}.{name}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def download(url: str, storage_options: Mapping[str, Any] | None = None) -> Path:
    """``url`` (a file or a folder) copied to this machine: its local path, which lasts as
    long as this process (weights on the meta device are read at the set-up, later)."""
    remote = Remote(url, storage_options)
    folder = staging_folder() / f"{os.getpid()}.{secrets.token_hex(4)}.download"
    folder.mkdir()
    atexit.register(shutil.rmtree, folder, True)
    local = folder / name_of(url)
    if remote.isdir(url):
        local.mkdir()
        for entry in remote.listing(url):
            if not entry.is_dir:
                remote.get(join(url, entry.name), local / entry.name)
    elif remote.exists(url):
        remote.get(url, local)
    return local


def upload_tree(local: Path, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """The file or folder ``local`` uploaded to ``url`` (a folder's files, one by one; the
    weights first, an index or config after them)."""
    remote = Remote(url, storage_options)
    if local.is_file():
        remote.put(local, url)
        return
    files = sorted(local.iterdir(), key=lambda p: (not p.name.endswith(".safetensors"), p.name))
    for path in files:
        if path.is_file():
            remote.put(path, join(url, path.name))
