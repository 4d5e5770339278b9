"""Where each sample an evaluation pass reads sits in the data's own order.

An evaluation pass shards data without padding (see :mod:`distkit.data._eval_rounds`): a
metric needs no order, but a prediction per sample does. How a rank's samples interleave
with the other ranks' follows from how the data is sharded:

* a map-style Dataset (or a DataLoader over one): rank ``r`` reads samples ``r, r + N, ...``
  (``N`` ranks), so its ``q``-th sample is sample ``q * N + r``: the dataset's index;
* a stream of samples that distkit shards: item ``p`` of the stream goes to rank ``p % N``:
  the same rule, the position in the stream;
* an iterable of batches that distkit shards: batch ``i`` goes to rank ``i % N``, so rank
  ``r``'s ``k``-th batch is batch ``k * N + r``; a sample's position counts the samples of
  every batch before it (which needs every rank's batch sizes);
* a :class:`~distkit.data.streams.ShardedStream`: each rank reads a share of its own, and no
  order across ranks exists; the order is rank 0's samples, then rank 1's, and so on, each in
  the order its rank read them.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from distkit.batch import batch_size_of
from distkit.data import LoaderSpec
from distkit.data._eval_rounds import map_rounds, stream_rounds
from distkit.data._stream_feed import StreamFeed
from distkit.data._stream_spec import StreamSpec
from distkit.strategies.base import Strategy


class SampleOrder(enum.Enum):
    """How ranks' evaluation samples interleave in the data's order."""

    SAMPLES = "samples"  # rank r's q-th sample is sample q * N + r
    BATCHES = "batches"  # rank r's k-th batch is batch k * N + r
    RANKS = "ranks"  # rank 0's samples, then rank 1's, ...


def sample_order(spec: LoaderSpec | StreamSpec) -> SampleOrder:
    """How ``spec``'s evaluation shards interleave (see the module's docstring)."""
    if not isinstance(spec, StreamSpec):
        return SampleOrder.SAMPLES
    if spec.self_sharded:
        return SampleOrder.RANKS
    return SampleOrder.BATCHES if spec.batch_size is None else SampleOrder.SAMPLES


def counted_batches(
    strategy: Strategy, spec: LoaderSpec | StreamSpec, seed: int
) -> Iterator[tuple[Any, int]]:
    """This rank's evaluation batches (those of ``eval_batches``, in the same order), each
    with its real samples: 0 for a spare forward pass that counts for nothing."""
    if isinstance(spec, StreamSpec):
        feed = StreamFeed(strategy, spec, slots=1, seed=seed, purpose="eval")
        # the feed counts a batch's samples so too: a counted batch is a whole local batch
        for batch, counted in stream_rounds(feed, announce=strategy.is_main):
            yield batch, batch_size_of(batch) if counted else 0
        return
    world, rank = strategy.data_world_size, strategy.data_rank
    loader = spec.eval_loader(world_size=world, rank=rank, seed=seed + rank)
    # the shard's batches as its sampler draws them (a batch of strings has no tensor to
    # measure); the spare passes after them count nothing
    drawn = loader.batch_sampler
    assert drawn is not None, "an evaluation loader batches with a sampler"
    sizes = itertools.chain((len(indices) for indices in drawn), itertools.repeat(0))
    for (batch, counted), size in zip(map_rounds(strategy, loader), sizes, strict=False):
        yield batch, size if counted else 0


def sample_positions(order: SampleOrder, counts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per rank, the positions in the data's order of its samples, in the order it read them.

    ``counts``: every rank's batch sizes (real samples), in the order it read them. The
    positions of all ranks together are ``0 .. total - 1``, each once. Pure.
    """
    world = len(counts)
    totals = [sum(sizes) for sizes in counts]
    if order is SampleOrder.SAMPLES:
        return [torch.arange(totals[r], dtype=torch.int64) * world + r for r in range(world)]
    if order is SampleOrder.RANKS:
        starts = [0, *itertools.accumulate(totals)]
        return [torch.arange(starts[r], starts[r] + totals[r]) for r in range(world)]
    # batches: rank r's k-th batch is batch k * world + r; walk the batches in that order
    parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    batches = sorted(
        (k * world + r, r, size) for r in range(world) for k, size in enumerate(counts[r])
    )
    start = 0
    for _, rank, size in batches:
        parts[rank].append(torch.arange(start, start + size))
        start += size
    return [torch.cat(p) if p else torch.zeros(0, dtype=torch.int64) for p in parts]
