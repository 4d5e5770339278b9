"""What ``rt.loader``'s DataLoader shows as its ``sampler`` and ``batch_sampler``: this
rank's share of the loader's current epoch, with ``set_epoch`` as ``DistributedSampler`` has.

The views read the loader's own plan (they draw nothing themselves): iterating one gives the
sample indices (or lists of them, one per micro-batch) this rank loads over the whole current
epoch, placeholders included (a rank with no sample in a short last batch loads one sample
whose loss weight is zero). ``set_epoch(e)`` makes the loader's next iteration epoch ``e``.

A DataLoader whose sampler is such a view holds one rank's share already; handing it to
distkit again would shard the share a second time, so :func:`refuse_rank_loader` stops it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torch.utils.data import Sampler
from typing_extensions import override

from distkit.errors import ConfigurationError


class RankBatches(Protocol):
    """The loader the views describe."""

    def rank_batches(self) -> Iterator[list[int]]:
        """This rank's sample indices per micro-batch, over the whole current epoch."""

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the next iteration's epoch."""


class RankSampler(Sampler[int]):
    """This rank's sample indices of the loader's current epoch, in the order it loads them."""

    def __init__(self, loader: RankBatches) -> None:
        self._loader = loader

    @override
    def __iter__(self) -> Iterator[int]:
        for batch in self._loader.rank_batches():
            yield from batch

    def __len__(self) -> int:
        return sum(len(batch) for batch in self._loader.rank_batches())

    def set_epoch(self, epoch: int) -> None:
        """The loader's next iteration is ``epoch`` (from where a resume left it when that is
        already its epoch, else from the epoch's start), as with ``DistributedSampler``."""
        self._loader.set_epoch(epoch)


class RankBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches (lists of sample indices) of the loader's current epoch."""

    def __init__(self, loader: RankBatches) -> None:
        self._loader = loader

    @override
    def __iter__(self) -> Iterator[list[int]]:
        return self._loader.rank_batches()

    def __len__(self) -> int:
        return sum(1 for _ in self._loader.rank_batches())

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`RankSampler.set_epoch`."""
        self._loader.set_epoch(epoch)


def refuse_rank_loader(data: Any, what: str) -> None:
    """Refuse a loader ``rt.loader`` returned, given as data to shard (a second time)."""
    if isinstance(getattr(data, "sampler", None), (RankSampler, RankBatchSampler)):
        raise ConfigurationError(
            f"{what} is a loader that rt.loader returned: it yields this rank's share of the "
            "data already, and sharding it again would train each rank on a part of its "
            "part. Pass the data itself (loader.dataset, or the Dataset or DataLoader given "
            "to rt.loader)"
        )
