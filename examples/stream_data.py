"""WebDataset-style tar shards for the streaming example: writing them, and reading them back
as a stream that can start anywhere.

A shard is a plain tar file; sample ``<key>`` is the members ``<key>.x.npy`` (its features, a
float32 vector saved with ``numpy.save``) and ``<key>.cls`` (its class, ASCII digits), one after
the other, as WebDataset writes them (nothing here needs the webdataset package). ``index.json``
beside the shards names them with their sample counts and the layout they were written with;
it is written last, so a folder without it holds no finished set.

The task: Gaussian blobs, one per class, in ``features`` dimensions, with their centres drawn
from the layout's seed. The samples are shuffled once, when written; a linear model already
separates most of them, and a small MLP reaches about 0.97 validation accuracy.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

INDEX = "index.json"
FORMAT = 1  # of index.json
Sample = tuple[torch.Tensor, torch.Tensor]


class ShardError(ValueError):
    """A shard folder exists but does not hold what its index says."""


@dataclass(frozen=True)
class Layout:
    """What a shard folder holds: how many shards of how many samples, and the task."""

    train_shards: int = 8
    val_shards: int = 2
    shard_size: int = 500  # samples per shard
    features: int = 32
    classes: int = 8
    spread: float = 0.7  # the standard deviation of the class centres (the noise's is 1)
    seed: int = 0


# ------------------------------------------------------------------------------ writing
def ensure_shards(folder: Path, layout: Layout, *, rewrite: bool = False) -> tuple[dict, bool]:
    """The folder's index, the shards written first when they are missing, were written with
    another layout, or ``rewrite``; and whether they were written now."""
    if not rewrite:
        try:
            index = read_index(folder)
        except (OSError, ShardError):
            pass
        else:
            if index["layout"] == asdict(layout):
                return index, False
    return write_shards(folder, layout), True


def write_shards(folder: Path, layout: Layout) -> dict:
    """Write the train and val shards into ``folder``, then the index; returns the index.

    The files are written into a temporary folder inside ``folder`` and moved into place one by
    one, the index last, after the old index is removed: a reader (or a run after a crash)
    never finds an index naming a shard that is half written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INDEX).unlink(missing_ok=True)
    rng = np.random.default_rng(layout.seed)
    centres = rng.normal(0.0, layout.spread, size=(layout.classes, layout.features))
    index: dict[str, Any] = {"format": FORMAT, "layout": asdict(layout)}
    scratch = Path(tempfile.mkdtemp(prefix=".writing-", dir=folder))
    try:
        for split, shards in (("train", layout.train_shards), ("val", layout.val_shards)):
            index[split] = []
            for number in range(shards):
                name = f"{split}-{number:06d}.tar"
                labels = rng.integers(layout.classes, size=layout.shard_size)
                noise = rng.normal(size=(layout.shard_size, layout.features))
                features = (centres[labels] + noise).astype(np.float32)
                _write_tar(scratch / name, f"{split}{number:06d}", features, labels)
                index[split].append({"file": name, "samples": layout.shard_size})
        for entry in (*index["train"], *index["val"]):
            os.replace(scratch / entry["file"], folder / entry["file"])
        (scratch / INDEX).write_text(json.dumps(index, indent=1))
        os.replace(scratch / INDEX, folder / INDEX)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return index


def _write_tar(path: Path, prefix: str, features: np.ndarray, labels: np.ndarray) -> None:
    with tarfile.open(path, "w") as tar:
        for i, (x, y) in enumerate(zip(features, labels, strict=True)):
            key = f"{prefix}{i:06d}"
            buffer = io.BytesIO()
            np.save(buffer, x, allow_pickle=False)
            _add(tar, f"{key}.x.npy", buffer.getvalue())
            _add(tar, f"{key}.cls", str(int(y)).encode())


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


# ------------------------------------------------------------------------------ reading
def read_index(folder: Path) -> dict:
    """The index of a finished shard folder; OSError when there is none, ShardError when it
    is not one this module wrote."""
    text = (folder / INDEX).read_text()
    try:
        index = json.loads(text)
        ok = index.get("format") == FORMAT and all(
            isinstance(entry["file"], str) and int(entry["samples"]) > 0
            for split in ("train", "val")
            for entry in index[split]
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ShardError(f"{folder / INDEX} is not a shard index of format {FORMAT}")
    return index


class ShardStream(IterableDataset):
    """The samples ``(features, class)`` of some shards, read in order, one tar after another.

    Args:
        folder: the shard folder.
        shards: ``(file name, samples)`` of each shard, from the index.
        shuffle_seed: each epoch reads the shards in an order drawn from ``(shuffle_seed,
            epoch)`` (distkit calls :meth:`set_epoch`); None: in the order given.
        rank, world_size: read only every ``world_size``-th shard of the epoch's order,
            from the ``rank``-th on (a stream that shards itself, for
            :class:`distkit.ShardedStream`); by default all of them.
        log: called with a line when :meth:`iter_from` seeks (None: quiet).
    """

    def __init__(
        self,
        folder: Path,
        shards: list[tuple[str, int]],
        *,
        shuffle_seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.shards = list(shards)
        self.shuffle_seed = shuffle_seed
        self.rank, self.world_size = rank, world_size
        self.log = log
        self.epoch = 0

    @classmethod
    def from_index(cls, folder: Path, index: dict, split: str, **kwargs: Any) -> ShardStream:
        shards = [(entry["file"], int(entry["samples"])) for entry in index[split]]
        return cls(folder, shards, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def files(self) -> list[tuple[str, int]]:
        """This reader's shards in this epoch's order."""
        order = list(range(len(self.shards)))
        if self.shuffle_seed is not None:
            rng = np.random.default_rng([self.shuffle_seed, self.epoch])
            order = rng.permutation(len(order)).tolist()
        return [self.shards[i] for i in order][self.rank :: self.world_size]

    def samples(self) -> int:
        """How many samples this reader yields in an epoch (by the index)."""
        return sum(samples for _, samples in self.files())

    def __iter__(self) -> Iterator[Sample]:
        for name, samples in self.files():
            yield from read_shard(self.folder / name, samples)

    def iter_from(self, position: int) -> Iterator[Sample]:
        """The samples from the ``position``-th on: whole shards are skipped by their counts in
        the index (not opened), then the first ones of the shard it lands in (read past, not
        decoded)."""
        files = self.files()
        skipped_shards = 0
        while files and position >= files[0][1]:
            position -= files.pop(0)[1]
            skipped_shards += 1
        if self.log is not None:
            worker = get_worker_info()
            who = "" if worker is None else f" (worker {worker.id})"
            where = f"{position} samples into {files[0][0]}" if files else "the end"
            self.log(
                f"stream{who}: seeking: skipped {skipped_shards} shard(s) unopened, "
                f"then to {where} undecoded"
            )
        for index, (name, samples) in enumerate(files):
            yield from read_shard(self.folder / name, samples, skip=position if index == 0 else 0)


def read_shard(path: Path, samples: int, *, skip: int = 0) -> Iterator[Sample]:
    """The samples of one shard after the first ``skip`` (whose members are not decoded);
    ShardError when it holds other than ``samples`` samples."""
    seen = 0
    key: str | None = None
    parts: dict[str, bytes] = {}
    with tarfile.open(path, "r|") as tar:  # a stream, as from a pipe or a URL: no seeking
        for member in tar:
            if not member.isfile():
                continue
            name_key, _, extension = member.name.rpartition("/")[2].partition(".")
            if name_key != key:
                if key is not None and seen > skip:
                    yield _decode(path, key, parts)
                key, parts = name_key, {}
                seen += 1
            if seen > skip:
                file = tar.extractfile(member)
                assert file is not None  # a regular file
                parts[extension] = file.read()
        if key is not None and seen > skip:
            yield _decode(path, key, parts)
    if seen != samples:
        raise ShardError(
            f"{path} holds {seen} samples, its index says {samples}: write the shards again "
            "(--write-shards)"
        )


def _decode(path: Path, key: str, parts: dict[str, bytes]) -> Sample:
    try:
        features = np.load(io.BytesIO(parts["x.npy"]), allow_pickle=False)
        label = int(parts["cls"])
    except (KeyError, ValueError, OSError) as exc:
        raise ShardError(f"{path}: sample {key!r} is not x.npy + cls ({exc})") from None
    return torch.from_numpy(features), torch.tensor(label)
