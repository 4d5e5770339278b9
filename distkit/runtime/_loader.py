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

from collections.abc import Callable, Generator
from typing import Any

from distkit.batch import to_device
from distkit.data import MicroBatch
from distkit.data._feed import Feed
from distkit.errors import ConfigurationError


class RuntimeLoader:
    """An iterable over this rank's batches, epoch after epoch (iterating again starts the
    next epoch, in its own order). ``len(loader)`` is this rank's batches per epoch.

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

    def __len__(self) -> int:
        remaining = self._feed.remaining(self._epoch, 0)
        if remaining is None:
            raise TypeError("a stream's length is not known ahead: iterate it")
        return remaining

    def epoch(self, epoch: int) -> RuntimeLoader:
        """Iterate ``epoch`` next (from its start): ``for batch in loader.epoch(3): ...``."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigurationError(f"epoch must be an integer >= 0, got {epoch!r}")
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
    def num_workers(self) -> int:
        """DataLoader worker processes per rank."""
        return self._feed.num_workers

    @property
    def current_epoch(self) -> int:
        """The epoch the next iteration yields (or the one being yielded)."""
        return self._epoch

    def __iter__(self) -> Generator[Any, None, None]:
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
            for batch, micro in self._feed.epoch(epoch, start, worker_seed, local_position=local):
                self._position += micro.samples  # handed out: a save from here on skips it
                self._enter(micro, epoch)
                yield to_device(batch, self._device)
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
