"""This rank's (and this DataLoader worker's) share of a stream, from a position on.

:class:`RankShare` is the IterableDataset a rank's DataLoader reads (or, for an iterable of
batches read in the main process, the iterable itself). Item ``i`` after the start goes to rank
``i % world_size`` when distkit shards the stream; the rank's ``q``-th item belongs to its local
batch ``q // per_batch``, and local batch ``j`` to worker ``j % num_workers``: the order a
DataLoader collects its workers' batches in, so the rank sees its batches in stream order.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from distkit.batch import batch_size_of
from distkit.errors import ConfigurationError

#: local batches read between two swaps of the generators (main process)
_SWAP_EVERY = 8


@dataclass(frozen=True)
class ShareRule:
    """Which items of the stream this rank keeps, and from where."""

    world_size: int  # 1 when the stream shards itself over ranks
    rank: int
    per_batch: int  # items per local batch (the batch size; 1 for an iterable of batches)
    start: int  # samples to skip first (of the whole stream, or of this rank's share)
    items_are_batches: bool  # an item's size is its batch size (else one sample)
    split_workers: bool  # distkit gives whole local batches to the workers in turn
    rng_seed: int | None  # seed torch/random/numpy with this while iterating (None: leave)


class RankShare(IterableDataset[Any]):
    """The items of ``source`` that this rank (and worker) keeps under ``rule``."""

    def __init__(self, source: Any, rule: ShareRule) -> None:
        self.source = source
        self.rule = rule

    def __iter__(self) -> Iterator[Any]:
        rule = self.rule
        if rule.rng_seed is None:
            return self._kept()
        if get_worker_info() is not None:  # a worker process: its generators are ours
            _seed_all(rule.rng_seed)
            return self._kept()
        # the main process: the model's generators must not see the stream's draws, nor the
        # stream the model's; swapped every few local batches (a swap costs ~0.1 ms, numpy's
        # state most)
        return _isolated(self._kept, rule.rng_seed, chunk=rule.per_batch * _SWAP_EVERY)

    def _kept(self) -> Iterator[Any]:
        """The items this rank (and worker) keeps, in stream order."""
        rule = self.rule
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        if not rule.split_workers:
            workers, worker = 1, 0
        for index, item in enumerate(self._items()):
            if index % rule.world_size != rule.rank:
                continue
            local_batch = index // rule.world_size // rule.per_batch
            if local_batch % workers == worker:
                yield item

    def _items(self) -> Iterator[Any]:
        """The source's items after the first ``start`` samples."""
        start, source = self.rule.start, self.source
        seek = getattr(source, "iter_from", None)
        if start and callable(seek):
            yield from seek(start)
            return
        iterator = iter(source)
        skipped = 0
        while skipped < start:
            try:
                item = next(iterator)
            except StopIteration:
                raise ConfigurationError(
                    f"cannot resume the stream at sample {start}: it ended after {skipped}. "
                    "Resume with the stream the checkpoint was trained on"
                ) from None
            skipped += batch_size_of(item) if self.rule.items_are_batches else 1
        if skipped != start:
            raise ConfigurationError(
                f"cannot resume the stream at sample {start}: its batches end at sample "
                f"{skipped}, not there. Resume with the stream the checkpoint was trained on "
                "(the same batches in the same order)"
            )
        yield from iterator


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _capture() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _restore(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def _isolated(make: Any, seed: int, *, chunk: int) -> Iterator[Any]:
    """``make()``'s items, drawn ``chunk`` at a time with generators of their own (seeded with
    ``seed``) and handed out with the caller's generators back in place."""
    outside = _capture()
    try:
        _seed_all(seed)
        iterator = make()
        inside = _capture()
    finally:
        _restore(outside)
    while True:
        outside = _capture()
        _restore(inside)
        try:
            items = list(islice(iterator, chunk))
        finally:
            inside = _capture()
            _restore(outside)
        yield from items
        if len(items) < chunk:
            return


def stream_seed(seed: int, epoch: int) -> int:
    """The generators' seed while a stream distkit shards is read (the same everywhere)."""
    return (seed * 1_000_003 + epoch * 7_919 + 17) % 2**63
