"""Where an epoch's micro-batches come from: a fixed plan (map-style data) or a stream.

The training loop asks a feed for ``(batch, MicroBatch)`` pairs from a sample position on;
it never asks which kind of data it trains on. :class:`MapFeed` zips a DataLoader over this
rank's planned batches with the plan's weights (every rank knows every rank's share in
advance); :class:`~distkit._streams.StreamFeed` learns them as the stream goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from distkit.data import GlobalBatchPlan, LoaderSpec, MicroBatch, PlanBatchSampler, reseed_workers
from distkit.data._eval_rounds import map_rounds, stream_rounds
from distkit.data._stream_feed import StreamFeed
from distkit.data._stream_spec import StreamSpec
from distkit.errors import ConfigurationError
from distkit.strategies.base import Strategy


class Feed(Protocol):
    """An epoch's micro-batches for this rank, the same number on every rank."""

    @property
    def num_workers(self) -> int:
        """DataLoader worker processes per rank (for the timing report)."""

    def remaining(self, epoch: int, position: int) -> int | None:
        """Micro-batches left in ``epoch`` from sample ``position`` on (None: unknown)."""

    def epoch(
        self, epoch: int, position: int, seed: int, *, local_position: int | None = None
    ) -> Iterator[tuple[Any, MicroBatch]]:
        """This rank's batches and their weights from sample ``position`` of ``epoch`` on.

        ``seed`` seeds this rank's DataLoader workers for the epoch; ``local_position`` is the
        samples this rank trained of the epoch (None: unknown, after a resume at another
        world size), for data that each rank reads on its own.
        """


class MapFeed:
    """A DataLoader over a :class:`PlanBatchSampler`, zipped with the plan's weights."""

    def __init__(
        self, strategy: Strategy, loader: Any, sampler: PlanBatchSampler, plan: GlobalBatchPlan
    ) -> None:
        self.strategy = strategy
        self.loader = loader
        self.sampler = sampler
        self.plan = plan

    @property
    def num_workers(self) -> int:
        return int(getattr(self.loader, "num_workers", 0))

    def remaining(self, epoch: int, position: int) -> int | None:
        return self.plan.remaining(position, epoch=epoch)

    def epoch(
        self, epoch: int, position: int, seed: int, *, local_position: int | None = None
    ) -> Iterator[tuple[Any, MicroBatch]]:
        self._check_same_order(epoch)
        self.sampler.set_epoch(epoch, position)
        reseed_workers(self.loader, seed)
        micro_batches = self.plan.micro_batches(position, epoch=epoch)
        return zip(self.loader, micro_batches, strict=True)

    def _check_same_order(self, epoch: int) -> None:
        """A user's sampler must draw the same order on every rank (a collective, per epoch)."""
        mine = self.plan.fingerprint(epoch)
        if mine is None or self.strategy.world_size == 1:
            return
        prints = self.strategy.all_gather(torch.tensor([mine], dtype=torch.int64))
        values = [int(v) for v in prints.reshape(-1).tolist()]
        if len(set(values)) > 1:
            differ = [rank for rank, value in enumerate(values) if value != values[0]]
            raise ConfigurationError(
                f"the training sampler drew a different order on rank(s) {differ} than on rank "
                f"0 in epoch {epoch}; distkit runs the sampler on every rank and gives each its "
                "share of every global batch, so every rank must draw the same order. Seed it "
                "from the epoch alone (distkit seeds torch, random and numpy, and a sampler's "
                "own `generator`, with seed + epoch while it draws) and do not shard by rank "
                "yourself (no DistributedSampler)"
            )


def train_feed(
    strategy: Strategy,
    spec: LoaderSpec | StreamSpec,
    plan: GlobalBatchPlan | None,
    *,
    seed: int,
    grad_accum_steps: int,
    drop_last: bool,
) -> Feed:
    """The feed of a fit's training data: a plan's (map-style data) or a stream's."""
    if isinstance(spec, StreamSpec):
        return StreamFeed(
            strategy,
            spec,
            slots=grad_accum_steps,
            seed=seed,
            drop_last=drop_last or spec.drop_last,
        )
    assert plan is not None, "map-style data has a plan"
    loader, sampler = spec.train_loader(plan, seed=seed + strategy.data_rank)
    return MapFeed(strategy, loader, sampler, plan)


def eval_batches(
    strategy: Strategy, spec: LoaderSpec | StreamSpec, seed: int
) -> Iterator[tuple[Any, bool]]:
    """This rank's evaluation batches, each with whether it counts (every sample once)."""
    if isinstance(spec, StreamSpec):
        feed = StreamFeed(strategy, spec, slots=1, seed=seed, purpose="eval")
        return stream_rounds(feed, announce=strategy.is_main)
    world, rank = strategy.data_world_size, strategy.data_rank
    loader = spec.eval_loader(world_size=world, rank=rank, seed=seed + rank)
    return map_rounds(strategy, loader)
