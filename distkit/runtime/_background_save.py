"""Saves that do not stop training: staged now, persisted by a thread on rank 0.

A save is a collective as before (every rank's state is gathered into rank 0's payload);
then, instead of writing, rank 0 *stages* the payload (every tensor copied off the training
tensors: to pinned host memory from a GPU, so the copy is the only time training waits) and
hands it to a writer thread, and every rank goes on. The write is the same atomic one as a
blocking save's, so the checkpoint becomes visible (a rename locally, an upload's end on a
store) only once it is complete and verified.

Each rank holds a :class:`PendingSave` for the save in flight. :meth:`PendingSave.wait` is a
collective: rank 0 waits for its writer, and every rank learns how the write went (a failed
write raises on every rank, as a blocking save's does). The next save waits for the one
before it, and so do a fit's end and a Runtime's close: never two saves in flight, and no
read of a checkpoint that is still being written.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distkit.runtime._rank_zero_write import share_outcome
from distkit.strategies.base import Strategy


def storages(module: nn.Module) -> set[int]:
    """The addresses of the storages of ``module``'s parameters and buffers (what training
    changes in place)."""
    found = set()
    for tensor in module.state_dict(keep_vars=True).values():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
            found.add(local.untyped_storage().data_ptr())
    return found


def stage_payload(payload: dict[str, Any], models: dict[str, set[int]]) -> dict[str, Any]:
    """The payload staged: every tensor copied (:func:`stage`), but in the entries named in
    ``models`` (a model's state, which the backend's state gathering made as copies already)
    only those sharing a storage with the model they came from (the addresses given)."""
    return {
        key: stage(value, only=models.get(key)) if key in models else stage(value)
        for key, value in payload.items()
    }


def stage(value: Any, only: set[int] | None = None) -> Any:
    """``value`` with every tensor copied to host memory of its own (containers rebuilt):
    what training does to its tensors next cannot reach the copy. Meta tensors (a sharded
    checkpoint's names and shapes) are kept as they are; with ``only``, so is every tensor
    whose storage is not one of those."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return value
        if only is not None and value.untyped_storage().data_ptr() not in only:
            return value
        tensor = value.detach()
        if tensor.device.type == "cuda":
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return staged.copy_(tensor, non_blocking=True)
        return tensor.clone()
    if isinstance(value, dict):
        return {key: stage(item, only) for key, item in value.items()}
    if isinstance(value, list):
        return [stage(item, only) for item in value]
    if isinstance(value, tuple):
        return tuple(stage(item, only) for item in value)
    return value


class PendingSave:
    """A save whose write may still be running (on rank 0; the other ranks hold a handle
    for the same save). Returned by ``rt.save(..., blocking=False)``.

    Call :meth:`wait` on every rank (it is a collective: every rank learns whether rank 0's
    write succeeded); :meth:`done` says, on this rank, whether it has finished.
    """

    def __init__(self, strategy: Strategy, what: str, thread: threading.Thread | None) -> None:
        self._strategy = strategy
        self._what = what
        self._thread = thread
        self._failure: BaseException | None = None
        self._settled = False
        #: seconds the last :meth:`wait` blocked this rank (0.0 before one)
        self.waited_s = 0.0

    @classmethod
    def start(
        cls,
        strategy: Strategy,
        payload: dict[str, Any] | None,
        write: Callable[[dict[str, Any]], object],
        what: str,
        models: dict[str, nn.Module] | None = None,
    ) -> PendingSave:
        """Stage ``payload`` (rank 0's; None elsewhere) and write it on a thread. ``models``:
        the payload's entries that are a model's state, by the module they came from (their
        tensors are copied only where they share the module's storages)."""
        if payload is None:
            return cls(strategy, what, None)
        live = {key: storages(module) for key, module in (models or {}).items()}
        staged = stage_payload(payload, live)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the pinned copies are complete before training goes on
        pending = cls(strategy, what, None)

        def persist() -> None:
            try:
                write(staged)
            except BaseException as exc:
                pending._failure = exc

        # not a daemon: a script that ends without waiting still leaves a complete file
        # (the interpreter waits for the thread at its exit)
        thread = threading.Thread(target=persist, name=f"distkit-save: {what}")
        pending._thread = thread
        thread.start()
        return pending

    @property
    def what(self) -> str:
        """What is being saved, as messages name it ("the checkpoint <path>")."""
        return self._what

    def done(self) -> bool:
        """Whether this rank's part is over (rank 0: its write finished, well or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> float:
        """Block until the save is persisted; every rank raises where rank 0's write failed.
        A collective: call it on every rank. Returns the seconds it blocked (0 when the write
        had finished); a second call returns at once."""
        if self._settled:
            return 0.0
        started = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        self._settled = True
        failure = self._failure
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # KeyboardInterrupt and the like: as they were
        share_outcome(self._strategy, failure, self._what)
        self.waited_s = time.perf_counter() - started
        return self.waited_s

    def finish_here(self) -> None:
        """Let rank 0's write finish, without telling the other ranks (no collective): for a
        run that is failing or being torn down, where a collective could hang. A write that
        completes leaves a committed checkpoint; one that fails leaves the previous one
        (Ctrl-C during the wait abandons it: the previous one stays the newest)."""
        if self._thread is not None and self._thread.is_alive():
            print(
                f"distkit: finishing {self._what} before stopping (Ctrl-C abandons it; the "
                "checkpoint before it stays the newest)",
                file=sys.stderr,
                flush=True,
            )
            self._thread.join()
        self._settled = True

    def __repr__(self) -> str:
        state = "done" if self.done() else "persisting"
        return f"PendingSave({self._what!r}, {state})"
