"""A user's sampler or batch sampler, run identically on every rank, then sharded exactly.

distkit draws the user's whole epoch on every rank, with every random source it can reach
seeded from ``(seed, epoch)`` alone (torch's, ``random``'s and numpy's global RNGs, forked for
the draw, and a copy of the sampler's own ``generator``), so every rank draws the same order
and a resumed run draws the same order again. Then:

* a sampler's order is cut into global batches of ``world_size * batch_size`` consecutive
  indices, exactly as distkit's own permutation is (:class:`SamplerPlan`);
* a batch sampler's batches are one process's micro-batches: ``world_size`` consecutive
  batches make a global micro-batch, of which rank ``r`` trains the ``r``-th whole
  (:class:`BatchSamplerPlan`), so a bucket stays a bucket.

Either way N processes train as one process would with the whole global batch. Each plan
fingerprints its draw, so the loop can check once per epoch that all ranks drew alike.
"""

from __future__ import annotations

import copy
import hashlib
import math
import operator
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from typing_extensions import override

from distkit.data import GlobalBatchPlan
from distkit.errors import ConfigurationError

T = TypeVar("T")

_WHAT = "train_data"


def mix(*values: int) -> int:
    """A non-negative 63-bit number from integers (a seed, or a fingerprint)."""
    data = b"".join(int(v).to_bytes(16, "little", signed=True) for v in values)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def digest_of(*arrays: list[int]) -> int:
    """A 63-bit digest of lists of integers (their lengths included)."""
    digest = hashlib.blake2b(digest_size=8)
    for values in arrays:
        digest.update(len(values).to_bytes(8, "little"))
        digest.update(np.asarray(values, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


def draw(source: Iterable[T], *, seed: int, epoch: int) -> list[T]:
    """Everything ``source`` yields for ``epoch``, seeded by ``(seed, epoch)`` alone.

    ``set_epoch(epoch)`` is called first where the sampler (or a batch sampler's ``sampler``)
    has it. The global RNGs are restored afterwards, so training's random streams (dropout)
    do not depend on the draw; the user's sampler and generator are left as they were.
    """
    for part in (source, getattr(source, "sampler", None)):
        set_epoch = getattr(part, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
    seeded = _reseeded(source, seed, epoch)
    value = mix(seed, epoch)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would reseed (and not restore) CUDA's
            torch.default_generator.manual_seed(value)
            random.seed(value)
            np.random.seed(value % 2**32)
            return list(seeded)
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _reseeded(source: T, seed: int, epoch: int, *, inner: bool = True) -> T:
    """``source``, or a shallow copy whose torch ``generator`` (its own, or its ``sampler``'s)
    is a fresh one seeded from ``(seed, epoch, the user's generator's initial seed)``: the
    user's seed still counts, the user's objects are not advanced, and a resumed run redraws
    the same order."""
    changes: dict[str, Any] = {}
    generator = getattr(source, "generator", None)
    if isinstance(generator, torch.Generator):
        fresh = torch.Generator(device=generator.device)
        changes["generator"] = fresh.manual_seed(mix(seed, epoch, generator.initial_seed()))
    sampler = getattr(source, "sampler", None) if inner else None
    if sampler is not None:
        reseeded_inner = _reseeded(sampler, seed, epoch, inner=False)
        if reseeded_inner is not sampler:
            changes["sampler"] = reseeded_inner
    if not changes:
        return source
    clone = copy.copy(source)
    for name, value in changes.items():
        setattr(clone, name, value)
    return clone


def length_of(source: object, kind: str) -> int:
    """``len(source)``, or a clear error naming the sampler."""
    name = type(source).__name__
    try:
        length = len(source)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigurationError(
            f"{_WHAT}'s {kind} {name} has no len(); distkit needs the number of "
            f"{'batches' if kind == 'batch_sampler' else 'indices'} it yields per epoch "
            f"before training (every rank agrees on the batch plan). Give {name} a __len__."
        ) from None
    if length <= 0:
        raise ConfigurationError(
            f"{_WHAT}'s {kind} {name} is empty (len() is {length}); it must yield at least "
            "one " + ("batch" if kind == "batch_sampler" else "index") + " per epoch"
        )
    return length


def _index(value: object, kind: str, name: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigurationError(
            f"{_WHAT}'s {kind} {name} yielded {value!r} ({type(value).__name__}); distkit "
            "shards integer indices into a map-style dataset"
        ) from None


class _EpochDraws(Generic[T]):
    """The latest epoch's draw of a sampler, converted, so an epoch is drawn once."""

    def __init__(
        self,
        source: Iterable[Any],
        *,
        kind: str,
        length: int,
        seed: int,
        convert: Callable[[list[Any], int], T],
    ) -> None:
        self.source = source
        self.kind = kind
        self.length = length
        self.seed = seed
        self.convert = convert
        self._latest: tuple[int, T] | None = None

    def get(self, epoch: int) -> T:
        if self._latest is None or self._latest[0] != epoch:
            drawn = draw(self.source, seed=self.seed, epoch=epoch)
            if len(drawn) != self.length:
                name = type(self.source).__name__
                what = "batches" if self.kind == "batch_sampler" else "indices"
                raise ConfigurationError(
                    f"{_WHAT}'s {self.kind} {name} yielded {len(drawn)} {what} in epoch "
                    f"{epoch} but its len() is {self.length}; distkit plans every epoch from "
                    f"len() (the same on every rank). Make {name}.__len__ return the number "
                    f"of {what} it yields."
                )
            self._latest = (epoch, self.convert(drawn, epoch))
        return self._latest[1]


class SamplerPlan(GlobalBatchPlan):
    """Global batches of ``world_size * batch_size`` consecutive indices of the order a
    user's sampler draws each epoch (the same on every rank); ``len(sampler)`` per epoch."""

    def __init__(
        self,
        sampler: Iterable[int],
        *,
        batch_size: int,
        world_size: int,
        rank: int,
        grad_accum_steps: int = 1,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.sampler = sampler
        length = length_of(sampler, "sampler")
        self._draws = _EpochDraws(
            sampler, kind="sampler", length=length, seed=seed, convert=self._convert
        )
        super().__init__(
            length,
            batch_size=batch_size,
            world_size=world_size,
            rank=rank,
            grad_accum_steps=grad_accum_steps,
            shuffle=False,
            seed=seed,
            drop_last=drop_last,
        )

    def _convert(self, drawn: list[Any], epoch: int) -> tuple[torch.Tensor, int]:
        name = type(self.sampler).__name__
        order = [_index(value, "sampler", name) for value in drawn]
        return torch.tensor(order, dtype=torch.int64), digest_of(order)

    @override
    def order(self, epoch: int) -> torch.Tensor:
        """The sampler's order for ``epoch`` (drawn once per epoch)."""
        return self._draws.get(epoch)[0]

    @override
    def fingerprint(self, epoch: int) -> int:
        return self._draws.get(epoch)[1]

    @override
    def _source(self) -> str:
        return f"sampler={type(self.sampler).__name__} ({self.num_samples} per epoch)"


class _BatchDraw:
    """One epoch of a batch sampler: its batches, cut into global micro-batches."""

    def __init__(self, batches: list[list[int]], world_size: int, drop_last: bool) -> None:
        groups = [batches[i : i + world_size] for i in range(0, len(batches), world_size)]
        if drop_last and len(groups[-1]) < world_size:
            groups.pop()
        self.groups = groups
        self.starts = [0]  # the sample position where each global micro-batch begins
        for group in groups:
            self.starts.append(self.starts[-1] + sum(len(batch) for batch in group))
        self.fingerprint = digest_of([len(b) for b in batches], [i for b in batches for i in b])


class BatchSamplerPlan(GlobalBatchPlan):
    """A user's batch sampler's batches as one process's micro-batches: ``world_size``
    consecutive batches make a global micro-batch, and rank ``r`` trains the ``r``-th whole.

    Rank ``r`` with no batch in a short last group trains a one-sample placeholder of
    weight 0. Sizes vary per batch and per epoch, so positions and counts need the epoch.
    Steps, accumulation and loss weights follow :class:`~distkit.data.GlobalBatchPlan`.
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        *,
        world_size: int,
        rank: int,
        grad_accum_steps: int = 1,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        # GlobalBatchPlan's fixed-size batches do not apply: only its settings, step and
        # weight rules (micro_batches, steps_per_epoch)
        self.batch_sampler = batch_sampler
        self.num_batches = length_of(batch_sampler, "batch_sampler")
        self.world_size, self.rank = world_size, rank
        self.grad_accum_steps, self.seed = grad_accum_steps, seed
        self.shuffle, self.drop_last = False, drop_last
        groups = self.num_batches / world_size
        self._len = math.floor(groups) if drop_last else math.ceil(groups)
        if not self._len:
            name = type(batch_sampler).__name__
            raise ConfigurationError(
                f"drop_last=True leaves no batch: {name} yields {self.num_batches} batch(es) "
                f"per epoch and a global micro-batch takes one from each of {world_size} "
                "processes. Use fewer processes, smaller batches, or drop_last=False."
            )
        self._draws = _EpochDraws(
            batch_sampler,
            kind="batch_sampler",
            length=self.num_batches,
            seed=seed,
            convert=self._convert,
        )

    def _convert(self, drawn: list[Any], epoch: int) -> _BatchDraw:
        name = type(self.batch_sampler).__name__
        batches = []
        for k, batch in enumerate(drawn):
            indices = [_index(value, "batch_sampler", name) for value in batch]
            if not indices:
                raise ConfigurationError(
                    f"{_WHAT}'s batch_sampler {name} yielded an empty batch (batch {k} of "
                    f"epoch {epoch}); every batch needs at least one index"
                )
            batches.append(indices)
        return _BatchDraw(batches, self.world_size, self.drop_last)

    @override
    def __len__(self) -> int:
        return self._len

    def _first_group(self, start: int, epoch: int) -> tuple[_BatchDraw, int]:
        drawn = self._draws.get(epoch)
        try:
            return drawn, drawn.starts.index(start)
        except ValueError:
            shown = ", ".join(map(str, drawn.starts[:6])) + (
                ", ..." if len(drawn.starts) > 6 else ""
            )
            raise ConfigurationError(
                f"sample position {start} is not where a global micro-batch of epoch {epoch} "
                f"begins in {type(self.batch_sampler).__name__}'s batches ({shown}); a "
                "mid-epoch resume with a batch_sampler needs the same batch_sampler, seed "
                "and number of processes. Resume from a checkpoint saved at the end of an "
                "epoch (checkpoint_every='epoch') otherwise."
            ) from None

    @override
    def _layout(self, start: int, epoch: int) -> list[tuple[int, int]]:
        drawn, first = self._first_group(start, epoch)
        return [
            (
                sum(len(batch) for batch in group),
                len(group[self.rank]) if self.rank < len(group) else 0,
            )
            for group in drawn.groups[first:]
        ]

    @override
    def local_batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        drawn, first = self._first_group(start, epoch)
        for group in drawn.groups[first:]:
            yield group[self.rank] if self.rank < len(group) else group[0][:1]

    @override
    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's indices in the order its global micro-batches take them."""
        groups = self._draws.get(epoch).groups
        return torch.tensor([i for group in groups for batch in group for i in batch])

    @override
    def fingerprint(self, epoch: int) -> int:
        return self._draws.get(epoch).fingerprint

    @override
    def describe(self) -> str:
        name = type(self.batch_sampler).__name__
        return (
            f"one batch of batch_sampler={name} ({self.num_batches} per epoch) per rank x "
            f"{self.grad_accum_steps} accumulated, {len(self)} micro-batches per epoch, "
            f"drop_last={self.drop_last}"
        )

    @override
    @property
    def samples_per_epoch(self) -> int | None:
        return None

    @override
    @property
    def local_batch_size(self) -> int | None:
        return None
