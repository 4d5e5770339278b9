"""Streams as training and validation data: how distkit shards them, and how a stream says
that it shards itself.

``train_data`` / ``val_data`` may be a stream instead of a map-style Dataset:

* a :class:`torch.utils.data.IterableDataset` of samples (or a DataLoader over one): distkit
  batches it with ``batch_size`` (a DataLoader's own settings win);
* any other iterable of batches (a generator's iterable, a WebDataset pipeline that batches,
  a DataLoader with ``batch_size=None`` over an IterableDataset of batches).

By default every process reads the whole stream (every worker too) and keeps its share, as for
a Dataset: sample ``p`` of the stream goes to rank ``p % world_size`` (batch ``i`` of an
iterable of batches to rank ``i % world_size``), and within a rank, whole local batches go to
the DataLoader workers in turn. So N processes with batch ``b`` train like one process with
``N * b``, whatever the number of workers. The stream must yield the same items in the same
order in every process: distkit seeds torch, ``random`` and numpy with ``seed`` and the epoch
while it iterates (and calls the stream's ``set_epoch(epoch)``, if it has one), so a stream
that shuffles with those generators agrees with itself everywhere. distkit checks it: every
process digests each global micro-batch it reads, and a stream whose processes read other items
(a generator of its own seeded differently per process) is refused on every process, naming
the first global micro-batch that differs.

A stream that already yields only this process's share (files split by rank, Hugging Face's
``split_dataset_by_node``) says so with :class:`ShardedStream`.

Resuming mid-epoch skips the samples the checkpoint had consumed: the stream is read (and
decoded) up to that point. A stream that can seek defines ``iter_from(position)``, which
returns an iterator starting at sample ``position`` (of the whole stream, or, for a
:class:`ShardedStream`, of this process's share), and distkit calls it instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import Dataset, IterableDataset
from typing_extensions import override

from distkit.errors import ConfigurationError


class ShardedStream(IterableDataset[Any]):
    """A stream that yields only this process's share: distkit takes it as it comes.

    Args:
        stream: an IterableDataset of samples, or any iterable of batches.
        splits_workers: the stream also splits itself over DataLoader workers (with
            ``torch.utils.data.get_worker_info()``). By default distkit gives whole batches of
            this process's stream to the workers in turn (each worker reads the process's
            whole stream).

    Ranks may hold different amounts: every rank stops at the same optimizer step when the
    last one runs out, and the last steps weigh each sample alike. Which samples form a global
    batch depends on the number of processes, so the world-size rule (N processes with batch
    ``b`` train like one with ``N * b``) holds only as far as the sharding keeps it. A
    mid-epoch resume needs the same number of processes.
    """

    def __init__(self, stream: Iterable[Any], *, splits_workers: bool = False) -> None:
        if isinstance(stream, ShardedStream):
            raise ConfigurationError("ShardedStream(ShardedStream(...)): wrap the stream once")
        if isinstance(stream, Dataset) and not isinstance(stream, IterableDataset):
            raise ConfigurationError(
                f"ShardedStream wraps streams; {type(stream).__name__} is a map-style Dataset, "
                "which distkit shards itself: pass it without ShardedStream"
            )
        if not isinstance(stream, Iterable) or isinstance(stream, (str, bytes)):
            raise ConfigurationError(
                f"ShardedStream takes an IterableDataset or an iterable of batches, got "
                f"{type(stream).__name__}"
            )
        self.stream = stream
        self.splits_workers = splits_workers

    @override
    def __iter__(self) -> Iterator[Any]:
        return iter(self.stream)

    @override
    def __repr__(self) -> str:
        return f"ShardedStream({self.stream!r}, splits_workers={self.splits_workers})"
