"""Who holds the default process group distkit made, and when it may go.

A sweep makes one Trainer (or Runtime) after another in one process, and the next one is
often made before the last is gone: ``trainer = distkit.Trainer(...)`` in a loop builds the new
Trainer, which joins the group the old one made, and only then drops the old one. The old one's
teardown used to destroy the group under the new one ("Default process group has not been
initialized" at the second fit). So every strategy that joins distkit's group holds a lease on
it, and the group goes only with the last lease.

*When* the last lease goes must be the same on every rank, or one rank destroys its group and
makes a new one while another still uses the old: a hang. An explicit ``close()`` (a ``with``
block's end, ``Trainer.close()``) runs at the same point of the script on every rank; the
garbage collector does not (it runs when a rank's allocations say so, and a Trainer in a
reference cycle goes at another moment on each rank). So:

- an explicit close collects garbage first (every Trainer the script dropped is released at the
  same point on every rank), then releases its lease, and the last one destroys the group;
- a lease the garbage collector releases never destroys a group of more than one rank: the
  group is kept, idle, for the next Trainer, or until an explicit close or the process ends
  (a world of one has no peer to disagree with, and goes at once, as before).

A group the user made (``torch.distributed.init_process_group`` before distkit) is never
leased or destroyed.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class _Lease:
    group: Any  # the default group distkit made (compared by identity)
    world_size: int
    holders: int


_lease: _Lease | None = None
_explicit_closes = 0  # explicit closes in progress (nested: a close inside a close)


def made(world_size: int) -> None:
    """distkit just made the default group: its first lease (the caller's)."""
    global _lease
    _lease = _Lease(_default_group(), world_size, 1)


def join() -> bool:
    """A strategy joins the default group that exists: True (a lease taken) if distkit made
    it, False if the user did (never distkit's to destroy)."""
    lease = _current()
    if lease is None:
        return False
    lease.holders += 1
    return True


def release(*, before_destroy: Callable[[], None] | None = None) -> bool:
    """Give a lease back; the group is destroyed with the last one (see the module's rules),
    ``before_destroy`` called first. Whether it was destroyed."""
    global _lease
    if _current() is None:
        return False
    if _explicit_closes and _lease is not None and _lease.holders > 1:
        gc.collect()  # the dropped Trainers release theirs here, at this point on every rank
    lease = _current()
    if lease is None:  # a dropped holder's teardown, run just now, found it gone
        return False
    lease.holders -= 1
    if lease.holders > 0 or (lease.world_size > 1 and not _explicit_closes):
        return False
    if before_destroy is not None:
        before_destroy()
    _lease = None
    if dist.is_initialized():
        dist.destroy_process_group()
    return True


def holders() -> int:
    """Leases held on distkit's default group (0: none, or the group is the user's)."""
    lease = _current()
    return 0 if lease is None else lease.holders


@contextlib.contextmanager
def explicit_close() -> Iterator[None]:
    """A close the script asked for (the same point on every rank): inside it the last
    lease destroys the group, whatever the world size."""
    global _explicit_closes
    _explicit_closes += 1
    try:
        yield
    finally:
        _explicit_closes -= 1


def _current() -> _Lease | None:
    """The lease, if the default group is still the one distkit made (one destroyed behind
    distkit's back, or replaced by the user's, is no longer distkit's)."""
    global _lease
    if _lease is not None and (not dist.is_initialized() or _default_group() is not _lease.group):
        _lease = None
    return _lease


def _default_group() -> Any:
    return dist.distributed_c10d._get_default_group()
