"""The collectives every strategy offers the trainer (and users), over a backend's core ops.

A backend implements the underscored core (``_all_reduce``, ``_broadcast``, ``_all_gather``,
``_all_gather_object``, ``barrier``); the public calls check their arguments and share one
behaviour. :meth:`Collectives.all_reduce_async` is for the host's bookkeeping (how many samples
each rank holds next): a backend that can overlap it with training returns before it is done.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from distkit.errors import ConfigurationError

REDUCE_OPS = ("mean", "sum")


class PendingSum(Protocol):
    """A sum over ranks under way; :meth:`wait` returns it (a CPU tensor). Backends may add
    ``done() -> bool`` (whether :meth:`wait` would return at once): a caller that waits on a
    sum some rank may never join watches the ranks meanwhile (see runtime/_call_tags)."""

    def wait(self) -> torch.Tensor: ...


class DoneSum:
    """A :class:`PendingSum` that was computed at once."""

    def __init__(self, total: torch.Tensor) -> None:
        self._total = total

    def wait(self) -> torch.Tensor:
        return self._total

    def done(self) -> bool:
        return True


class Collectives:
    """Mixed into :class:`~distkit.Strategy`: the collectives, checked, over the core ops."""

    # ------------------------------------------------------------------ the backend's core
    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Out-of-place sum/mean over ranks (a mean is only asked of floating tensors)."""

    @abstractmethod
    def _broadcast(self, obj: Any, src: int) -> Any:
        """Any picklable object from ``src`` to every rank."""

    @abstractmethod
    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack (new leading dim of size world_size) of every rank's same-shape tensor."""

    @abstractmethod
    def _all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    @abstractmethod
    def is_main(self) -> bool: ...

    # ------------------------------------------------------------------ the public calls
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` over ranks; returns a new tensor and leaves the input unchanged.

        Args:
            tensor: same shape and dtype on every rank.
            op: ``"mean"`` or ``"sum"``.
        """
        if op not in REDUCE_OPS:
            raise ConfigurationError(f"unknown reduce op {op!r}. Allowed: {', '.join(REDUCE_OPS)}")
        _require_tensor(tensor, "all_reduce")
        if op == "mean" and not tensor.is_floating_point():
            tensor = tensor.double()  # the mean of integers is not an integer
        return self._all_reduce(tensor, op)

    def all_reduce_async(self, tensor: torch.Tensor, *, name: str) -> PendingSum:
        """Start summing a small CPU tensor over ranks; ``.wait()`` returns the sum (CPU).

        Every rank starts the same sums in the same order; ``name`` tells them apart where a
        backend matches operations by name (Horovod): the same on every rank, and not that of
        another sum still under way. The default sums at once (correct for any backend);
        torch.distributed sums on a gloo group in the background and Horovod with
        ``allreduce_async``, so a sum started a step ahead is done when it is read, and
        reading it synchronises no device.
        """
        _require_tensor(tensor, "all_reduce_async")
        if tensor.device.type != "cpu":
            raise ConfigurationError(
                f"all_reduce_async sums host-side numbers; got a tensor on {tensor.device}. "
                "Pass a CPU tensor (use all_reduce for device tensors)"
            )
        total = self.all_reduce(tensor, op="sum")
        # a backend that summed on its device hands back a device tensor: home it once
        return DoneSum(total if total.device.type == "cpu" else total.cpu())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` holds it, on every rank (any picklable object)."""
        _require_rank(src, "src", self.world_size)
        return self._broadcast(obj, src)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor stacked along a new first dimension (same shape on every rank)."""
        _require_tensor(tensor, "all_gather")
        return self._all_gather(tensor)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""
        return self._all_gather_object(obj)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. to download or cache), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


def _require_rank(value: int, what: str, world_size: int) -> None:
    if not 0 <= value < world_size:
        raise ConfigurationError(f"{what}={value} is not a rank; allowed 0..{world_size - 1}")


def _require_tensor(value: object, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ConfigurationError(
            f"{what} takes a torch.Tensor, got {type(value).__name__}; "
            "wrap numbers with torch.tensor(...) or use broadcast/all_gather_object for objects"
        )
