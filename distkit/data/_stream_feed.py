"""A stream's micro-batches with exact weights, and one end for every rank.

No rank knows ahead how much of a stream the others hold. Each rank reads its batches a block
of ``steps_ahead`` optimizer steps at a time and tells every other how many samples each of
them has (one host-side sum over ranks of a ``world_size x steps x slots`` table of counts).
From the table every rank knows, for each step of the block, alike: whether the step happens
at all (some rank has data), how many micro-batch passes it runs (the most any rank has: a
rank short of data runs a stand-in batch whose loss weight is zero, so every rank joins every
collective), and each micro-batch's loss weight ``world_size * count / step samples``, the
same weighting as a fixed plan.

The same sum carries, for a stream distkit shards, a digest of each global micro-batch of the
block (every rank reads all of its items, so every rank digests all of them, where they are
read): every rank must have read the same items, or some samples would train twice and others
never. Each rank fills only its own row, so the sum holds every rank's digests side by side,
and a stream whose ranks read other items (an unseeded shuffle) is refused on every rank alike
at the first global micro-batch that differs, with no collective of its own.

Under tensor parallelism the ranks of one tensor-parallel group share one data-parallel rank
and must read the same batches: each rank then fills a row of its own (a stream that shards
itself digests its own batches), and a group whose rows differ (a ShardedStream split by the
global rank) is refused on every rank alike, before its batches train; the rest reads the
first row of each group.

The table of the next block is summed while this block trains (its batches are read a block
ahead: at most ``2 x steps_ahead`` steps of batches are held), on a backend that can (gloo
beside the model's group, Horovod's async allreduce): reading it then waits for nothing and
synchronises no device. The first block of an epoch waits for its table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice, pairwise
from typing import Any

import torch

from distkit.batch import batch_size_of
from distkit.data import MicroBatch
from distkit.data._stream_spec import StreamSpec
from distkit.errors import ConfigurationError
from distkit.strategies._collectives import PendingSum
from distkit.strategies.base import Strategy


class StreamFeed:
    """Micro-batches of a stream, ``slots`` per optimizer step (1 for evaluation)."""

    def __init__(
        self,
        strategy: Strategy,
        spec: StreamSpec,
        *,
        slots: int,
        seed: int,
        drop_last: bool = False,
        purpose: str = "train",
        steps_ahead: int = 4,
    ) -> None:
        self.strategy = strategy
        self.spec = spec
        self.slots = slots
        self.seed = seed
        self.drop_last = drop_last
        self.purpose = purpose
        #: steps whose batches are read (and counted over ranks) at once, a block ahead
        self.steps_ahead = steps_ahead
        self._stand_in: Any = None  # this rank's latest real batch
        self._sums = 0  # sums started (names them for Horovod)
        self._ended = False  # a rank's share fell short in this epoch (a stream distkit shards)

    @property
    def num_workers(self) -> int:
        return self.spec.num_workers

    def remaining(self, epoch: int, position: int) -> int | None:
        return None  # a stream's length is not known

    def epoch(
        self, epoch: int, position: int, seed: int, *, local_position: int | None = None
    ) -> Iterator[tuple[Any, MicroBatch]]:
        strategy, spec = self.strategy, self.spec
        if spec.self_sharded and position and local_position is None:
            raise ConfigurationError(
                f"the checkpoint stopped mid-epoch in {spec.what}, a ShardedStream, at another "
                f"number of processes than {strategy.data_world_size}: each process's place in its "
                "own share cannot be carried over. Resume with the number of processes it was "
                "saved with, or from a checkpoint saved at the end of an epoch"
            )
        start = (local_position or 0) if spec.self_sharded else position
        self._ended = False
        local = spec.local_batches(
            world_size=strategy.data_world_size,
            rank=strategy.data_rank,
            epoch=epoch,
            start=start,
            seed=self.seed,
            worker_seed=seed,
            digest_own=self._split(),
        )
        return self._steps(local, epoch, fresh=position == 0, start=start)

    def _split(self) -> bool:
        """Whether tensor-parallel groups share data-parallel ranks (each rank then has a row
        of its own in the table, see the module's docstring)."""
        return self.strategy.data_world_size < self.strategy.world_size

    def _steps(
        self, local: Iterator[tuple[Any, int]], epoch: int, *, fresh: bool, start: int
    ) -> Iterator[tuple[Any, MicroBatch]]:
        strategy, block = self.strategy, self.steps_ahead
        world, rank = strategy.data_world_size, strategy.data_rank
        current, pending = self._fetch(local)
        step = 0
        read = 0  # local batches of the blocks before this one
        while True:
            # per rank: the counts, then the digests, of each step's micro-batches
            rows = strategy.world_size if self._split() else world
            counted, digested = zip(
                *pending.wait().reshape(rows, 2, block, self.slots).tolist(), strict=True
            )
            table, digests = list(counted), list(digested)
            if self._split():
                table, digests = self._per_share(table, digests, epoch, first=read)
            if not self.spec.self_sharded:
                self._check_same_items(table, digests, epoch, first=read, start=start)
                self._check_one_stream(table, epoch)
            read += block * self.slots
            steps, cut = self._block_steps(table)
            if not steps:
                if fresh and step == 0:
                    raise self._empty(epoch, dropped=cut)
                return
            # a rank that read a whole block may have more; when none did, all are done
            fullest = max(sum(1 for row in rank_table for n in row if n) for rank_table in table)
            more = not cut and fullest == block * self.slots
            if more:  # the next block's batches and their table, summed while this one trains
                ahead, pending = self._fetch(local)
            for index, counts in enumerate(steps):
                passes = max(sum(1 for n in row if n) for row in counts)
                total = sum(sum(row[:passes]) for row in counts)
                mine = current[index * self.slots : (index + 1) * self.slots]
                for slot in range(passes):
                    count = counts[rank][slot]
                    own = slot < len(mine) and count > 0
                    batch = mine[slot] if own else self._stand_in_for(epoch, counts)
                    yield (
                        batch,
                        MicroBatch(
                            step=step,
                            last_in_step=slot == passes - 1,
                            count=count,
                            weight=world * count / total,
                            samples=sum(row[slot] for row in counts),
                            step_samples=total,
                        ),
                    )
                step += 1
            if not more or len(steps) < block:
                return
            current = ahead

    def _fetch(self, local: Iterator[tuple[Any, int]]) -> tuple[list[Any], PendingSum]:
        """This rank's batches for the next block of steps (fewer at its end), and the sum of
        their table started: ``world_size x 2 x steps_ahead x slots``, each rank's sample counts
        and the digests of the global micro-batches it holds a batch of (0 where none)."""
        pairs = list(islice(local, self.steps_ahead * self.slots))
        batches = [batch for batch, _ in pairs]
        split = self._split()
        rows = self.strategy.world_size if split else self.strategy.data_world_size
        table = torch.zeros(rows, 2, self.steps_ahead * self.slots, dtype=torch.int64)
        if pairs:
            sizes = [_size(batch, self.spec.what) for batch in batches]
            mine = torch.tensor([sizes, [digest for _, digest in pairs]], dtype=torch.int64)
            table[self.strategy.rank if split else self.strategy.data_rank, :, : len(pairs)] = mine
        if pairs:
            self._stand_in = batches[-1]
        self._sums += 1
        name = f"distkit.stream.{self.purpose}.{self._sums}"
        return batches, self.strategy.all_reduce_async(table.reshape(-1), name=name)

    def _per_share(
        self,
        table: Sequence[list[list[int]]],
        digests: Sequence[list[list[int]]],
        epoch: int,
        *,
        first: int,
    ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """Every rank's rows as one per data-parallel rank (its tensor-parallel group's first),
        after checking that the group's ranks read the same batches (counts and digests)."""
        groups = self.strategy.data_groups
        for share, ranks in enumerate(groups):
            lead = ranks[0]
            for other in ranks[1:]:
                if table[other] == table[lead] and digests[other] == digests[lead]:
                    continue
                where = "" if self.purpose == "eval" else f" in epoch {epoch}"
                raise ConfigurationError(
                    f"ranks {ranks} form one tensor-parallel group (data-parallel rank {share}) "
                    f"and read different batches from {self.spec.what}{where} (from its "
                    f"global micro-batch {first} on): they split each layer of one model copy "
                    "and must see the same samples. A ShardedStream must shard by the "
                    "data-parallel rank (rt.data_rank of rt.data_world_size), not by the "
                    "global rank; or pass the stream unwrapped and distkit shards it"
                )
        leads = [ranks[0] for ranks in groups]
        return [table[r] for r in leads], [digests[r] for r in leads]

    def _block_steps(self, table: Sequence[list[list[int]]]) -> tuple[list[list[list[int]]], bool]:
        """The steps of a block that train (each ``world_size x slots`` counts), and whether
        the epoch ends after them (a partial global batch under drop_last)."""
        world = len(table)
        steps: list[list[list[int]]] = []
        for index in range(self.steps_ahead):
            counts = [table[r][index] for r in range(world)]
            passes = max(sum(1 for n in row if n) for row in counts)
            if passes == 0:
                return steps, False
            if self.drop_last:
                for slot in range(passes):
                    if not self._full([row[slot] for row in counts]):
                        if slot:
                            steps.append([row[:slot] for row in counts])
                        return steps, True
            steps.append(counts)
        return steps, False

    def _check_same_items(
        self,
        table: Sequence[list[list[int]]],
        digests: Sequence[list[list[int]]],
        epoch: int,
        *,
        first: int,
        start: int,
    ) -> None:
        """Refuse a block whose ranks read other items at the same place of the stream: the
        ranks that hold a batch of a global micro-batch must hold the same digest of it.
        ``first`` global micro-batches came before the block, after ``start`` samples."""
        world = len(table)
        for index in range(self.steps_ahead * self.slots):
            row, slot = divmod(index, self.slots)
            held = {r: digests[r][row][slot] for r in range(world) if table[r][row][slot]}
            if len(set(held.values())) > 1:
                raise self._disagreement(first + index, held, epoch, start=start)

    def _disagreement(
        self, index: int, held: dict[int, int], epoch: int, *, start: int
    ) -> ConfigurationError:
        world, per_batch = self.strategy.data_world_size, self.spec.batch_size
        base = min(held)
        differ = [r for r, digest in held.items() if digest != held[base]]
        if per_batch is None:  # an iterable of batches: batch i of the stream goes to rank i % N
            where = f"batches {index * world} to {(index + 1) * world - 1}"
        else:
            span = world * per_batch
            where = f"samples {start + index * span} to {start + (index + 1) * span - 1}"
        after = f", counted from sample {start} where this run resumed" if start else ""
        when = "" if self.purpose == "eval" else f"epoch {epoch}, "
        return ConfigurationError(
            f"{self.spec.what} yields different data on different ranks ({when}{where} of the "
            f"stream{after}, its global micro-batch {index}: rank(s) {differ} read other items "
            f"there than rank {base}). distkit reads the whole stream on every rank and keeps "
            "each rank's share, so every rank must read the same items in the same order, or "
            "some samples train twice and others never. The likely cause is an unseeded "
            "shuffle (or random transform): a generator seeded differently on each rank, such "
            "as np.random.default_rng() or random.Random() without a seed. Draw from torch's, "
            "random's or numpy's global generator, which distkit seeds alike on every rank "
            "while it reads the stream, or seed your own generator from the epoch (distkit "
            "calls the stream's set_epoch(epoch)). A stream that is different on each rank by "
            "design (it reads a part per rank) is a distkit.ShardedStream"
        )

    def _check_one_stream(self, table: Sequence[list[list[int]]], epoch: int) -> None:
        """Refuse counts that no single stream read by every rank can give: a stream distkit
        shards must yield the same items on every rank, so its ranks' shares of a global
        micro-batch differ by at most one sample (a batch, for an iterable of batches), the
        lower ranks holding more, and once one rank's share falls short none has more."""
        world = len(table)
        columns = [
            [table[r][i][j] for r in range(world)]
            for i in range(self.steps_ahead)
            for j in range(self.slots)
        ]
        per_rank = self.spec.batch_size
        for column in columns:
            present = [1 if n else 0 for n in column]
            shares = present if per_rank is None else column
            ordered = all(a >= b for a, b in pairwise(shares))
            if (self._ended and any(column)) or not ordered or max(shares) - min(shares) > 1:
                raise ConfigurationError(
                    f"{self.spec.what} yields different data on different ranks (epoch {epoch}: "
                    f"a global micro-batch of {column} samples per rank): distkit reads the "
                    "whole stream on every rank and keeps each rank's share, so the stream must "
                    "yield the same items in the same order everywhere (seed its shuffling from "
                    "torch/random/numpy, which distkit seeds alike, or set_epoch). A stream "
                    "that reads a part per rank is a distkit.ShardedStream"
                )
            full = all(present) if per_rank is None else min(column) == per_rank
            self._ended = self._ended or not full

    def _full(self, column: list[int]) -> bool:
        """Whether a global micro-batch is whole (every rank's share of it full)."""
        if self.spec.batch_size is None:
            return all(column)
        return sum(column) == self.spec.batch_size * len(column)

    def _stand_in_for(self, epoch: int, counts: list[list[int]]) -> Any:
        if self._stand_in is None:  # resumed past the end of this rank's share: its first
            strategy = self.strategy
            first = self.spec.local_batches(
                world_size=strategy.data_world_size,
                rank=strategy.data_rank,
                epoch=epoch,
                start=0,
                seed=self.seed,
                worker_seed=0,
            )
            self._stand_in = next((batch for batch, _ in first), None)
        if self._stand_in is None:
            holders = [r for r, row in enumerate(counts) if sum(row)]
            raise ConfigurationError(
                f"rank {self.strategy.data_rank} has no batch of {self.spec.what} in epoch {epoch} "
                f"while rank(s) {holders} do: every process must join each step, and this one "
                "has no batch to stand in with (it takes its latest). Give every process at "
                "least one batch (more samples than processes; a ShardedStream with a share "
                "for every rank), or use fewer processes"
            )
        return self._stand_in

    def _empty(self, epoch: int, *, dropped: bool) -> ConfigurationError:
        spec = self.spec
        if dropped:
            why = (
                "drop_last=True dropped its first global batch, which is partial (fewer "
                f"samples than {self.strategy.data_world_size} processes x batch_size). Lower "
                "batch_size or set drop_last=False"
            )
        elif spec.one_shot:
            why = (
                f"it is an iterator ({type(spec.source).__name__}), which can be read once and "
                "was read already. Pass an iterable whose __iter__ starts afresh"
            )
        else:
            why = "it yielded nothing on every process. Check the stream"
        when = "" if self.purpose == "eval" else f" in epoch {epoch}"
        return ConfigurationError(f"{spec.what} has no data{when}: {why}")


def _size(batch: Any, what: str) -> int:
    size = batch_size_of(batch)
    if size <= 0:
        raise ConfigurationError(
            f"a batch of {what} has no samples that distkit can count ({type(batch).__name__}): "
            "a batch must hold tensors whose first dimension is the batch (e.g. (inputs, "
            "target)); distkit weighs each step by its samples"
        )
    return size
