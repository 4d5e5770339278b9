"""This rank's (and this DataLoader worker's) share of a stream, from a position on.

:class:`RankShare` is the IterableDataset a rank's DataLoader reads (or, for an iterable of
batches read in the main process, the iterable itself). Item ``i`` after the start goes to rank
``i % world_size`` when distkit shards the stream; the rank's ``q``-th item belongs to its local
batch ``q // per_batch``, and local batch ``j`` to worker ``j % num_workers``: the order a
DataLoader collects its workers' batches in, so the rank sees its batches in stream order.

Items ``g * world_size * per_batch`` to ``(g + 1) * world_size * per_batch - 1`` are the ``g``-th
global micro-batch: every rank's local batch ``g``. Every rank reads all of them, so every rank
can digest all of them (:class:`ItemsDigest`) and the ranks can compare what they read without
sending any item: a rank reading another stream (an unseeded shuffle) shows at the first global
micro-batch that differs. The digest is made where the items are read (in the DataLoader
worker that makes local batch ``g``) and travels with the batch.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, default_convert, get_worker_info
from typing_extensions import override

from distkit.batch import batch_size_of
from distkit.errors import ConfigurationError

#: local batches read between two swaps of the generators (main process)
_SWAP_EVERY = 8
#: a tensor, array or bytes object up to this size is digested whole; a larger one by its dtype,
#: shape and ``_SAMPLED`` elements spread evenly over it (first and last included): enough to
#: tell two samples apart, at a bounded cost for large images
_WHOLE_BYTES = 1 << 16
_SAMPLED = 4096
#: nesting below which an item's parts count by their type only (a cycle cannot recurse)
_MAX_DEPTH = 16
#: a digest's bits: it is summed over ranks with zeros, and a sum in float64 keeps 48 bits exact
_DIGEST_BITS = 48


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
    digest: bool = False  # yield (item, digest of its global micro-batch) pairs


class RankShare(IterableDataset[Any]):
    """The items of ``source`` that this rank (and worker) keeps under ``rule``."""

    def __init__(self, source: Any, rule: ShareRule) -> None:
        self.source = source
        self.rule = rule

    @override
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
        if rule.digest:
            yield from self._digested(workers, worker)
            return
        for index, item in enumerate(self._items()):
            if index % rule.world_size != rule.rank:
                continue
            local_batch = index // rule.world_size // rule.per_batch
            if local_batch % workers == worker:
                yield item

    def _digested(self, workers: int, worker: int) -> Iterator[tuple[Any, int]]:
        """The items this rank (and worker) keeps, each with the digest of its global
        micro-batch: all of the batch's items, every rank's included (so a rank's items are
        held until the batch's last item is read: at most ``world_size - 1`` more)."""
        rule = self.rule
        span = rule.world_size * rule.per_batch
        mine: list[Any] = []
        digest = ItemsDigest()
        for index, item in enumerate(self._items()):
            global_batch, offset = divmod(index, span)
            if global_batch % workers != worker:
                continue
            digest.add(item)
            if index % rule.world_size == rule.rank:
                mine.append(item)
            if offset == span - 1:
                value = digest.value()
                yield from ((kept, value) for kept in mine)
                mine, digest = [], ItemsDigest()
        value = digest.value()  # a partial last global micro-batch
        yield from ((kept, value) for kept in mine)

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


class DigestCollate:
    """A DataLoader's ``collate_fn`` for ``(item, digest)`` pairs: ``(batch, digest)``, the
    batch made by ``collate`` (the user's, or the DataLoader's default) from the items."""

    def __init__(self, collate: Callable[[Any], Any] | None, *, batched: bool) -> None:
        self.batched = batched
        self.collate = collate or (default_collate if batched else default_convert)

    def __call__(self, data: Any) -> tuple[Any, int]:
        if not self.batched:  # an item is a batch
            item, digest = data
            return self.collate(item), digest
        # the DataLoader takes per_batch items at a time: one local batch, one digest
        return self.collate([item for item, _ in data]), data[0][1]


class ItemsDigest:
    """A digest of items in order (a global micro-batch's): equal items give equal digests on
    every rank and in every process; two different samples almost surely do not.

    Tensors and numpy arrays count by dtype, shape and bytes (of at most ``_SAMPLED`` elements
    of a large one); numbers, strings and bytes by value; lists, tuples and mappings by their
    parts in order; any other object by its type only. A tensor off the CPU counts by dtype and
    shape alone: reading its bytes would synchronise the device.
    """

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=8)

    def add(self, item: Any) -> None:
        self._hash.update(b"|")
        _digest_into(self._hash.update, item, 0)

    def value(self) -> int:
        """The digest so far, in ``[1, 2**48)`` (0 is left for "no batch here")."""
        value = int.from_bytes(self._hash.digest(), "little") >> (64 - _DIGEST_BITS)
        return value or 1


def _digest_into(update: Callable[[Any], None], value: Any, depth: int) -> None:
    # the usual parts of a sample first: this runs for every item of the stream on every rank
    if isinstance(value, torch.Tensor):
        _digest_tensor(update, value)
    elif isinstance(value, (list, tuple)) and depth < _MAX_DEPTH:
        update(b"[%d" % len(value))
        for part in value:
            _digest_into(update, part, depth + 1)
    elif isinstance(value, np.ndarray):
        _digest_array(update, value)
    elif isinstance(value, (bool, int, float, complex)) or value is None:
        update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, str):
        _digest_bytes(update, value.encode("utf-8", "surrogatepass"), b"s")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _digest_bytes(update, bytes(value) if isinstance(value, memoryview) else value, b"b")
    elif isinstance(value, np.generic):
        update(f"{value.dtype.str}:".encode())
        update(value.tobytes())
    elif isinstance(value, Mapping) and depth < _MAX_DEPTH:
        update(b"{%d" % len(value))
        for key, part in value.items():
            _digest_into(update, key, depth + 1)
            _digest_into(update, part, depth + 1)
    else:  # its repr or pickle may hold an address or a random order: its type only
        update(type(value).__qualname__.encode())


def _digest_tensor(update: Callable[[Any], None], tensor: torch.Tensor) -> None:
    update(_header("T", tensor.dtype, tensor.shape))
    if not tensor.is_cpu:  # reading a device tensor's bytes would synchronise the device
        return
    try:  # a view of the values: a dense CPU tensor, out of autograd, of a dtype numpy has
        array = tensor.numpy()
    except (TypeError, RuntimeError):
        if tensor.layout != torch.strided or tensor.is_quantized:
            return
        tensor = tensor.detach().resolve_conj().resolve_neg().as_subclass(torch.Tensor)
        tensor = tensor.reshape(-1)
        if tensor.numel() * tensor.element_size() > _WHOLE_BYTES:
            tensor = tensor[torch.from_numpy(_sample_positions(tensor.numel()))]
        array = tensor.contiguous().view(torch.uint8).numpy()  # bfloat16's bytes
    _digest_values(update, array)


def _digest_array(update: Callable[[Any], None], array: np.ndarray) -> None:
    update(_header("A", array.dtype, array.shape))
    if not array.dtype.hasobject:  # objects' bytes are addresses
        _digest_values(update, array)


def _digest_values(update: Callable[[Any], None], array: np.ndarray) -> None:
    if array.nbytes > _WHOLE_BYTES:
        positions = _sample_positions(array.size)
        flat = array.reshape(-1) if array.flags.c_contiguous else array.flat  # no copy
        array = flat[positions]
    try:
        update(array)  # its buffer: C-contiguous
    except (BufferError, TypeError, ValueError):  # strided, or a dtype with no buffer format
        update(array.tobytes())  # the same bytes, in C order


@functools.lru_cache(maxsize=1024)
def _header(kind: str, dtype: Any, shape: tuple[int, ...]) -> bytes:
    return f"{kind}{dtype}{tuple(shape)}".encode()


def _digest_bytes(update: Callable[[Any], None], data: bytes | bytearray, kind: bytes) -> None:
    update(kind + len(data).to_bytes(8, "little"))
    if len(data) > _WHOLE_BYTES:
        step = (len(data) - 1) // (_SAMPLED - 1)
        data = data[::step]
    update(data)


@functools.lru_cache(maxsize=64)
def _sample_positions(size: int) -> np.ndarray:
    """``_SAMPLED`` positions spread evenly over ``size`` elements, the first and last too."""
    return np.arange(_SAMPLED, dtype=np.int64) * (size - 1) // (_SAMPLED - 1)


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
