"""Sharding data over ranks so that training does not depend on the number of processes.

The rule: global batch ``k`` is the same set of samples whatever the world size. Every epoch one
permutation of the whole dataset (seeded by ``seed + epoch``, identical on every rank) is cut into
global batches of ``world_size * batch_size``; rank ``r`` takes every ``world_size``-th sample of
each, starting at ``r``. A short last global batch is split as evenly as it goes; a rank left
with nothing gets one placeholder sample whose loss weight is zero, so every rank still joins the
gradient all-reduce. Each micro-batch's loss is weighted by ``world_size * n_local / n_step`` so
the averaged gradient is exactly the mean over the samples of the optimizer step, as one process
with the whole batch would compute it.

A DataLoader's own sampler (``WeightedRandomSampler``, ...) or batch sampler (length
bucketing, ...) replaces the permutation: every rank draws it alike, and
:mod:`distkit.data._samplers` shards its draw by the same rules.

Evaluation gives rank ``r`` the samples ``r, r + world_size, ...`` with no padding, so metrics
count every sample exactly once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
)
from typing_extensions import override

from distkit.data._collate import explained_collate
from distkit.data._rank_view import refuse_rank_loader
from distkit.errors import ConfigurationError
from distkit.faults._preempt import active_signals, shield_worker


@dataclass(slots=True)
class MicroBatch:
    """What the trainer needs to know about one local batch before it sees the data.

    Never changed once made (not frozen only because one is made per batch, and a frozen
    dataclass's ``__init__`` costs three times a plain one's)."""

    step: int  # optimizer step this micro-batch belongs to
    last_in_step: bool  # gradients are synchronised after this one
    count: int  # real samples on this rank (0 for a placeholder)
    weight: float  # multiply the batch-mean loss by this before backward
    samples: int  # samples in this global micro-batch, over all ranks
    #: samples in the whole optimizer step (every micro-batch of its window, every rank)
    step_samples: int = 0


class GlobalBatchPlan:
    """The deterministic assignment of samples to ranks, micro-batches and optimizer steps."""

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        world_size: int,
        rank: int,
        grad_accum_steps: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_samples < world_size:
            raise ConfigurationError(
                f"the training data has {num_samples} sample(s) but there are {world_size} "
                "processes; every process needs at least one sample. Use more data or fewer "
                "processes."
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.grad_accum_steps = grad_accum_steps
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.global_batch = world_size * batch_size
        if not self._sizes(0):
            raise ConfigurationError(
                f"drop_last=True leaves no batch: {num_samples} samples, global batch "
                f"{self.global_batch} ({world_size} processes x batch_size {batch_size}). Lower "
                "batch_size or set drop_last=False."
            )

    def _sizes(self, start: int) -> list[int]:
        """Global batch sizes for the samples of the epoch from position ``start`` on."""
        full, rest = divmod(self.num_samples - start, self.global_batch)
        return [self.global_batch] * full + ([rest] if rest and not self.drop_last else [])

    def _layout(self, start: int, epoch: int) -> list[tuple[int, int]]:
        """``(samples over all ranks, samples on this rank)`` of each global micro-batch of
        ``epoch`` from position ``start`` on."""
        return [(size, len(range(self.rank, size, self.world_size))) for size in self._sizes(start)]

    def __len__(self) -> int:
        """Micro-batches in a whole epoch (the same on every rank)."""
        return len(self._sizes(0))

    def remaining(self, start: int, epoch: int = 0) -> int:
        """Micro-batches left in an epoch resumed at sample position ``start``."""
        return len(self._layout(start, epoch))

    def fingerprint(self, epoch: int) -> int | None:
        """A number that differs when two ranks would draw different orders (None: they
        cannot, the order is distkit's own permutation)."""
        return None

    def describe(self) -> str:
        """How batches are made, for the ranks' agreement before ``fit``."""
        return (
            f"{self.batch_size} per rank x {self.grad_accum_steps} accumulated, {len(self)} "
            f"micro-batches per epoch, {self._source()}, drop_last={self.drop_last}"
        )

    def _source(self) -> str:
        return f"shuffle={self.shuffle}"

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples in an epoch's order (None: it varies from epoch to epoch)."""
        return self.num_samples

    @property
    def local_batch_size(self) -> int | None:
        """Samples per rank and micro-batch (None: a batch sampler's, whose sizes vary)."""
        return self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self) / self.grad_accum_steps)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of sample indices (identical on every rank)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def local_batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This rank's sample indices, one list per micro-batch, from position ``start``."""
        order = self.order(epoch).tolist()
        for size in self._sizes(start):
            chunk = order[start : start + size]
            start += size
            mine = chunk[self.rank :: self.world_size]
            yield mine if mine else chunk[:1]

    def micro_batches(self, start: int = 0, epoch: int = 0) -> Iterator[MicroBatch]:
        """Weights and boundaries of the micro-batches from position ``start`` on."""
        layout = self._layout(start, epoch)
        accum, world = self.grad_accum_steps, self.world_size
        if accum == 1:  # each micro-batch its own step (the usual case: no slicing, no sums)
            for step, (samples, count) in enumerate(layout):
                yield MicroBatch(step, True, count, world * count / samples, samples, samples)
            return
        for first in range(0, len(layout), accum):
            group = layout[first : first + accum]
            step_samples = sum(samples for samples, _ in group)
            for i, (samples, count) in enumerate(group):
                yield MicroBatch(
                    step=first // accum,
                    last_in_step=i == len(group) - 1,
                    count=count,
                    weight=self.world_size * count / step_samples,
                    samples=samples,
                    step_samples=step_samples,
                )


class PlanBatchSampler(Sampler[list[int]]):
    """Batch sampler that yields this rank's micro-batches of a :class:`GlobalBatchPlan`.

    Call :meth:`set_epoch` before each epoch (the trainer does), as with ``DistributedSampler``.
    """

    def __init__(self, plan: GlobalBatchPlan) -> None:
        self.plan = plan
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch (its permutation) and the sample position to begin at."""
        self.epoch = epoch
        self.start = start

    @override
    def __iter__(self) -> Iterator[list[int]]:
        return self.plan.local_batches(self.epoch, self.start)

    def __len__(self) -> int:
        return self.plan.remaining(self.start, epoch=self.epoch)


class ShardSampler(Sampler[int]):
    """Samples ``rank, rank + world_size, ...`` in order: each sample on exactly one rank."""

    def __init__(self, num_samples: int, *, world_size: int, rank: int) -> None:
        self._indices = range(rank, num_samples, world_size)

    @override
    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)


@dataclass(frozen=True)
class LoaderSpec:
    """How the user wants batches made, taken from a Dataset and the trainer or a DataLoader."""

    dataset: Dataset[Any]
    batch_size: int
    shuffle: bool
    drop_last: bool
    kwargs: dict[str, Any]  # DataLoader arguments that do not concern sampling
    #: a user's sampler (indices): it draws each epoch's order, identically on every rank
    sampler: Iterable[Any] | None = None
    #: a user's batch sampler (lists of indices): its batches are one process's micro-batches
    batch_sampler: Iterable[list[Any]] | None = None

    @classmethod
    def from_data(
        cls,
        data: Dataset[Any] | DataLoader[Any],
        *,
        batch_size: int,
        shuffle: bool,
        num_workers: int,
        pin_memory: bool,
        what: str,
    ) -> LoaderSpec:
        """Read a Dataset (with the trainer's settings) or a user's DataLoader (with its own)."""
        refuse_rank_loader(data, what)
        if isinstance(data, DataLoader):
            return cls._from_loader(data, what)
        if isinstance(data, (str, bytes)) or (
            not isinstance(data, Dataset) and not hasattr(data, "__getitem__")
        ):
            raise ConfigurationError(
                f"{what} must be a torch Dataset (or any object with __getitem__ and __len__) "
                f"or a DataLoader, got {type(data).__name__}"
            )
        _require_sized(data, what)
        # workers are not persistent: each epoch seeds them afresh (see reseed_workers), so a
        # resumed run draws the same augmentations as an uninterrupted one
        kwargs = {
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "collate_fn": explained_collate,  # torch's, its ragged-samples error explained
        }
        return cls(data, batch_size, shuffle, False, kwargs)

    @classmethod
    def _from_loader(cls, loader: DataLoader[Any], what: str) -> LoaderSpec:
        _require_sized(loader.dataset, what)
        kwargs: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": explained_collate
            if loader.collate_fn is default_collate
            else loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "persistent_workers": loader.persistent_workers,
        }
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        if loader.batch_size is None:
            batches = loader.batch_sampler
            if batches is None:
                raise ConfigurationError(
                    f"{what} is a DataLoader with batch_size=None (automatic batching off); "
                    "distkit must own batching to shard it over ranks. Pass batch_size=..., "
                    "a batch_sampler=..., or the Dataset itself."
                )
            _refuse_rank_sharding(batches, what)
            # evaluation shards samples one by one: batches of the sampler's size, if it says
            size = getattr(batches, "batch_size", None)
            size = size if isinstance(size, int) and size > 0 else 1
            return cls(loader.dataset, size, False, False, kwargs, batch_sampler=batches)
        sampler = loader.sampler
        _refuse_rank_sharding(sampler, what)
        # exactly these types (a subclass may draw otherwise): distkit's own permutation
        if type(sampler) is RandomSampler and not _draws_more(sampler):
            return cls(loader.dataset, loader.batch_size, True, loader.drop_last, kwargs)
        if type(sampler) is SequentialSampler:
            return cls(loader.dataset, loader.batch_size, False, loader.drop_last, kwargs)
        return cls(
            loader.dataset, loader.batch_size, False, loader.drop_last, kwargs, sampler=sampler
        )

    def train_loader(
        self, plan: GlobalBatchPlan, *, seed: int
    ) -> tuple[DataLoader[Any], PlanBatchSampler]:
        """A DataLoader over this rank's micro-batches, and its sampler (for ``set_epoch``)."""
        sampler = PlanBatchSampler(plan)
        kwargs = self._seeded_kwargs(seed)
        return DataLoader(self.dataset, batch_sampler=sampler, **kwargs), sampler

    def eval_loader(self, *, world_size: int, rank: int, seed: int) -> DataLoader[Any]:
        """A DataLoader over this rank's evaluation shard (no padding, no shuffling)."""
        sampler = ShardSampler(len(self), world_size=world_size, rank=rank)
        kwargs = self._seeded_kwargs(seed)
        kwargs.pop("persistent_workers", None)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, **kwargs)

    def _seeded_kwargs(self, seed: int) -> dict[str, Any]:
        kwargs = dict(self.kwargs)
        # A loader's own generator: creating an iterator draws a worker base seed, which would
        # otherwise come from (and advance) the global RNG that dropout uses, so a resumed run
        # would see different dropout masks than an uninterrupted one.
        kwargs["generator"] = torch.Generator().manual_seed(seed)
        if kwargs.get("num_workers", 0) > 0:
            kwargs["worker_init_fn"] = _WorkerSeeder(kwargs.get("worker_init_fn"))
        return kwargs

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


def reseed_workers(loader: DataLoader[Any], seed: int) -> None:
    """Make the next iteration's DataLoader worker seeds a function of ``seed`` alone."""
    if loader.generator is not None:
        loader.generator.manual_seed(seed)


class _WorkerSeeder:
    """Seeds numpy in each DataLoader worker (torch and ``random`` are seeded by torch), and
    has it ignore the signals that preempt the fit it was made in (its rank saves first)."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        self.shield = active_signals()  # taken along to a spawned worker, too

    def __call__(self, worker_id: int) -> None:
        shield_worker(self.shield)
        seed = torch.initial_seed() % 2**32
        np.random.seed(seed)
        random.seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _draws_more(sampler: RandomSampler) -> bool:
    """Whether a RandomSampler draws with replacement or another number of samples."""
    return sampler.replacement or sampler._num_samples is not None


def _refuse_rank_sharding(sampler: object, what: str) -> None:
    """Refuse a sampler (or a batch sampler's sampler) that gives each rank its own part."""
    for part in (sampler, getattr(sampler, "sampler", None)):
        if isinstance(part, DistributedSampler) or (
            hasattr(part, "num_replicas") and hasattr(part, "rank")
        ):
            raise ConfigurationError(
                f"{what} uses a {type(part).__name__}, which gives each process its own part "
                "of the data; distkit shards the data itself: every rank draws the same "
                "order, then takes its share of each global batch. Pass the sampler you "
                "would use in one process (or the Dataset, or shuffle=True): a "
                "DistributedSampler is not needed."
            )


def _require_sized(dataset: object, what: str) -> None:
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        raise ConfigurationError(
            f"{what} has no length ({type(dataset).__name__}); distkit shards map-style "
            "datasets (with __len__ and __getitem__). Wrap the stream in a map-style Dataset, "
            "or shard the IterableDataset yourself by rank inside __iter__."
        )
    if len(dataset) == 0:
        raise ConfigurationError(f"{what} is empty (0 samples)")
