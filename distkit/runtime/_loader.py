"""``rt.loader(data)``: this rank's share of every global batch, in a user's own loop.

The batches come from the same global batch plan as the Trainer's: global batch ``k`` holds
the same samples whatever the number of processes, a short last batch is split as evenly as
it goes (a rank left without a sample gets a placeholder whose loss weight is zero), and with
``grad_accum_steps=k`` the micro-batches fall into windows of ``k``. While the user's loop
holds a batch, the runtime knows that batch's micro-batch (:class:`~distkit.data.MicroBatch`):
its loss weight (``rt.backward``), and whether it ends a window (then the gradients are
synchronised and ``optimizer.step()`` steps).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _DatasetKind
from typing_extensions import override

from distkit.batch import to_device
from distkit.data import MicroBatch
from distkit.data._feed import Feed, MapFeed
from distkit.data._rank_view import RankBatchSampler, RankSampler
from distkit.data._stream_feed import StreamFeed
from distkit.errors import ConfigurationError


class RuntimeLoader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` over this rank's batches, epoch after epoch
    (iterating again starts the next epoch, in its own order), on this rank's device.

    What it says of itself is this rank's truth:

    - ``len(loader)``: this rank's micro-batches per epoch (the same on every rank);
    - ``batch_size``: samples per rank and micro-batch (``None`` for a user's batch sampler,
      whose sizes vary, as a DataLoader says); ``drop_last``: whether a short last global
      batch is dropped;
    - ``dataset``: the whole data (every rank's loader names the same one);
    - ``sampler`` / ``batch_sampler``: this rank's sample indices (or lists of them, one per
      micro-batch) over the current epoch, read from the plan; ``sampler.set_epoch(e)`` makes
      the next iteration epoch ``e`` (a no-op for the epoch a resumed loader is in);
    - ``num_workers``, ``collate_fn``, ``pin_memory``, ``timeout``, ``prefetch_factor``: those
      of the DataLoader each rank loads with.

    Those attributes are read-only (as torch's are after construction): the batches are
    planned over every rank, so ``rt.loader(data, batch_size=...)`` makes another.
    ``state_dict()`` / ``load_state_dict()`` hold the epoch and how far into it the loop got,
    for ``rt.save`` / ``rt.load``: a resumed loop continues with the next batch.
    """

    def __init__(
        self,
        feed: Feed,
        *,
        seed: int,
        rank: int,
        device: Any,
        enter: Callable[[MicroBatch | None, int], None],
        agree: Callable[[int, int], None] = lambda epoch, position: None,
        ended: Callable[[], None] = lambda: None,
    ) -> None:
        # (DataLoader.__init__ is not called: the DataLoader each rank loads with is the
        # feed's; the attributes describe it)
        self._describe(feed)
        self._feed = feed
        self._seed = seed
        self._rank = rank
        self._device = device
        self._enter = enter  # tells the runtime which micro-batch the loop now holds
        self._agree = agree  # every rank starts the same epoch here, at the same place
        self._ended = ended  # an epoch was iterated to its end (the runtime's checks)
        self._epoch = 0
        self._position = 0  # samples (over all ranks) of the epoch already handed out
        #: this rank's samples of the epoch handed out, where known after a resume (for data
        #: each rank reads on its own; None: unknown, after a resume at another world size)
        self._local_position: int | None = None
        self._iterating = False
        self._DataLoader__initialized = True  # torch refuses writes to batch_size & co now

    def _describe(self, feed: Feed) -> None:
        """The DataLoader attributes, as this rank loads: from the feed's DataLoader (map-
        style data) or the stream's settings."""
        if isinstance(feed, MapFeed):
            inner = feed.loader
            settings = {key: getattr(inner, key) for key in _SETTINGS}
            self.dataset = inner.dataset
            self.batch_size = feed.plan.local_batch_size
            self.drop_last = feed.plan.drop_last
            self._dataset_kind = _DatasetKind.Map
            context = inner.multiprocessing_context
        else:
            assert isinstance(feed, StreamFeed), f"a feed distkit makes, got {type(feed)}"
            spec = feed.spec
            settings = {key: spec.kwargs.get(key, _DEFAULTS[key]) for key in _SETTINGS}
            self.dataset = spec.source
            self.batch_size = spec.batch_size
            self.drop_last = feed.drop_last
            self._dataset_kind = _DatasetKind.Iterable
            context = spec.kwargs.get("multiprocessing_context")
        # the user's worker_init_fn, not distkit's seeding wrapper around it
        init = settings["worker_init_fn"]
        settings["worker_init_fn"] = getattr(init, "user_fn", init)
        for key, value in settings.items():
            setattr(self, key, value)
        self._DataLoader__multiprocessing_context = context
        self.generator = None  # distkit seeds the workers of each epoch itself
        self.sampler = RankSampler(self)
        self.batch_sampler = RankBatchSampler(self)
        self._iterator = None
        self._IterableDataset_len_called = None

    def rank_batches(self) -> Iterator[list[int]]:
        """This rank's sample indices per micro-batch over the whole current epoch (what
        ``sampler`` and ``batch_sampler`` iterate)."""
        feed = self._feed
        if not isinstance(feed, MapFeed):
            raise TypeError(
                "a stream's batches are read as it goes: its loader has no sample indices "
                "ahead (iterate the loader itself)"
            )
        return feed.plan.local_batches(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)``: iterate ``epoch`` next; from where a resume left
        it when it is the epoch the loader is in already, else from the epoch's start."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch != self._epoch:
            self.epoch(epoch)  # (a value that is no epoch is refused there, saying why)

    @override
    def __len__(self) -> int:
        remaining = self._feed.remaining(self._epoch, 0)
        if remaining is None:
            raise TypeError("a stream's length is not known ahead: iterate it")
        return remaining

    def epoch(self, epoch: int) -> RuntimeLoader:
        """Iterate ``epoch`` next (from its start): ``for batch in loader.epoch(3): ...``."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigurationError(f"epoch must be an integer >= 0, got {epoch!r}")
        if self._iterating:
            raise ConfigurationError(
                f"set_epoch({epoch}) while the loader is being iterated (epoch "
                f"{self._epoch}): choose the epoch before the loop over the loader, as "
                "with DistributedSampler.set_epoch"
            )
        self._epoch, self._position, self._local_position = epoch, 0, None
        return self

    def resume_at(self, epoch: int, position: int, local_position: int | None) -> RuntimeLoader:
        """Iterate ``epoch`` next from sample ``position`` (of every rank's); this rank's
        ``local_position`` where known (a Trainer's resumed fit)."""
        self._epoch, self._position, self._local_position = epoch, position, local_position
        return self

    def remaining(self) -> int | None:
        """This rank's batches left in the epoch the next iteration yields (None: a stream)."""
        return self._feed.remaining(self._epoch, self._position)

    @property
    def current_epoch(self) -> int:
        """The epoch the next iteration yields (or the one being yielded)."""
        return self._epoch

    @override
    def __iter__(self) -> Generator[Any, None, None]:  # type: ignore[override]
        if self._iterating:
            raise ConfigurationError(
                "this loader is already being iterated: finish (or break out of) that loop "
                "first; a loader yields one epoch at a time"
            )
        epoch, start = self._epoch, self._position
        # a collective: a rank iterating alone (its loop under `if rt.is_main:`) or at
        # another epoch fails here on every rank, instead of hanging in its backward
        self._agree(epoch, start)
        self._iterating = True
        worker_seed = self._seed * 1000003 + self._rank * 7919 + epoch
        try:
            local, self._local_position = self._local_position, None
            # per batch: the instance's dict written directly (DataLoader's __setattr__,
            # which guards batch_size & co, costs half a microsecond a write)
            attrs, enter, device = self.__dict__, self._enter, self._device
            for batch, micro in self._feed.epoch(epoch, start, worker_seed, local_position=local):
                attrs["_position"] += micro.samples  # handed out: a save from here on skips it
                enter(micro, epoch)
                yield to_device(batch, device)
            self._epoch, self._position = epoch + 1, 0
            self._ended()
        finally:
            self._enter(None, epoch)
            self._iterating = False

    def state_dict(self) -> dict[str, int]:
        """Where the loop is: the epoch, and the samples of it already handed out."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state_dict` returned (at any world size)."""
        epoch, position = state.get("epoch"), state.get("position")
        for name, value in (("epoch", epoch), ("position", position)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigurationError(
                    f"a loader state holds {name}={value!r}; expected an integer >= 0 (a "
                    "state from loader.state_dict())"
                )
        assert isinstance(epoch, int) and isinstance(position, int)
        self._epoch, self._position = epoch, position


#: the DataLoader settings a RuntimeLoader shows, and a stream's defaults for them
_DEFAULTS: dict[str, Any] = {
    "num_workers": 0,
    "collate_fn": None,
    "pin_memory": False,
    "timeout": 0,
    "worker_init_fn": None,
    "prefetch_factor": None,
    "persistent_workers": False,
    "pin_memory_device": "",
    "in_order": True,
}
_SETTINGS = tuple(_DEFAULTS)
