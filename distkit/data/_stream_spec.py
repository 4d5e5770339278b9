"""Reading a stream the user passed (IterableDataset, DataLoader over one, iterable of batches,
:class:`~distkit.data.streams.ShardedStream`) into how each epoch's local batches are made."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from distkit.data import _WorkerSeeder
from distkit.data._rank_view import refuse_rank_loader
from distkit.data._stream_share import DigestCollate, RankShare, ShareRule, stream_seed
from distkit.data.streams import ShardedStream
from distkit.errors import ConfigurationError

#: DataLoader settings kept from a user's DataLoader (the rest concern sampling)
_LOADER_KEYS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
)


def is_stream(data: Any) -> bool:
    """Whether ``data`` is a stream rather than a map-style Dataset (or DataLoader over one)."""
    if isinstance(data, DataLoader):
        return isinstance(data.dataset, IterableDataset)
    if isinstance(data, (IterableDataset, ShardedStream)):
        return True
    if isinstance(data, (str, bytes, Dataset)) or hasattr(data, "__getitem__"):
        return False
    return isinstance(data, Iterable)


@dataclass(frozen=True)
class StreamSpec:
    """How one stream is read, epoch after epoch."""

    source: Any  # what is iterated (a ShardedStream unwrapped)
    what: str  # "train_data" or "val_data", for messages
    batch_size: int | None  # samples per local batch; None: the items are batches
    self_sharded: bool  # a ShardedStream: every rank keeps all it reads
    splits_workers: bool  # the stream splits itself over DataLoader workers
    in_main: bool  # an iterable of batches that is not a Dataset: read in the main process
    drop_last: bool
    kwargs: dict[str, Any]  # DataLoader settings

    @classmethod
    def from_data(
        cls, data: Any, *, batch_size: int, num_workers: int, pin_memory: bool, what: str
    ) -> StreamSpec:
        refuse_rank_loader(data, what)
        kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
        drop_last = False
        if isinstance(data, DataLoader):
            kwargs = {key: getattr(data, key) for key in _LOADER_KEYS}
            if data.num_workers > 0:
                kwargs["prefetch_factor"] = data.prefetch_factor
            batch, drop_last, data = data.batch_size, data.drop_last, data.dataset
            items_are_batches = batch is None
        else:
            items_are_batches = not isinstance(data, (IterableDataset, ShardedStream)) or (
                isinstance(data, ShardedStream) and not isinstance(data.stream, Dataset)
            )
            batch = None if items_are_batches else batch_size
        sharded = isinstance(data, ShardedStream)
        source = data.stream if isinstance(data, ShardedStream) else data
        # an iterable of batches that is no Dataset (a generator, a user's own DataLoader)
        # brings its own reading: it is iterated in the main process
        in_main = not isinstance(source, Dataset)
        return cls(
            source=source,
            what=what,
            batch_size=batch,
            self_sharded=sharded,
            splits_workers=sharded and data.splits_workers,
            in_main=in_main,
            drop_last=drop_last,
            kwargs=kwargs,
        )

    @property
    def one_shot(self) -> bool:
        """An iterator (``iter(x) is x``): it can be read once only."""
        return isinstance(self.source, Iterator)

    @property
    def num_workers(self) -> int:
        return 0 if self.in_main else int(self.kwargs.get("num_workers", 0))

    def describe(self) -> str:
        kind = "iterable of batches" if self.batch_size is None else "stream of samples"
        owner = "sharded by the stream" if self.self_sharded else "sharded by distkit"
        return f"{kind} ({type(self.source).__name__}), {owner}"

    def local_batches(
        self,
        *,
        world_size: int,
        rank: int,
        epoch: int,
        start: int,
        seed: int,
        worker_seed: int,
        digest_own: bool = False,
    ) -> Iterator[tuple[Any, int]]:
        """This rank's batches of ``epoch`` after ``start`` samples (of the whole stream, or of
        this rank's share for a stream that shards itself), each with the digest of its global
        micro-batch where distkit shards the stream over several ranks (else 0).
        ``digest_own``: a stream that shards itself digests its own batches too (the ranks of
        a tensor-parallel group compare theirs)."""
        set_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        digest = (not self.self_sharded and world_size > 1) or (self.self_sharded and digest_own)
        rule = ShareRule(
            world_size=1 if self.self_sharded else world_size,
            rank=0 if self.self_sharded else rank,
            per_batch=self.batch_size or 1,
            start=start,
            items_are_batches=self.batch_size is None,
            split_workers=not self.splits_workers,
            rng_seed=None if self.self_sharded else stream_seed(seed, epoch),
            digest=digest,
        )
        share = RankShare(self.source, rule)
        if self.in_main:
            return iter(share) if digest else ((batch, 0) for batch in share)
        kwargs = dict(self.kwargs)
        kwargs["generator"] = torch.Generator().manual_seed(worker_seed)
        if kwargs.get("num_workers", 0) > 0:
            kwargs["worker_init_fn"] = _WorkerSeeder(kwargs.get("worker_init_fn"))
        if digest:
            batched = self.batch_size is not None
            kwargs["collate_fn"] = DigestCollate(kwargs.get("collate_fn"), batched=batched)
        loader = DataLoader(share, batch_size=self.batch_size, drop_last=False, **kwargs)
        return iter(loader) if digest else ((batch, 0) for batch in loader)


def check_stream(spec: StreamSpec, *, reads: int, because: str) -> None:
    """Refuse a stream that cannot be read ``reads`` times (``because`` says why it would be)."""
    if spec.one_shot and reads > 1:
        raise ConfigurationError(
            f"{spec.what} is an iterator ({type(spec.source).__name__}), which can be read once, "
            f"and {because}: the second reading would find it empty. Pass an iterable whose "
            "__iter__ starts afresh (an IterableDataset, or a class whose __iter__ returns a new "
            "generator), or read it once (max_epochs=1; max_steps bounds an epoch)"
        )
