"""The Runtime's calls that only the Trainer makes: its plumbing, kept off the user's face.

``Runtime``'s public names are the user's (see :mod:`distkit.runtime`); what the Trainer's
loop needs of a Runtime beyond them is here, as functions of the Runtime, exported with the
rest of the port.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distkit.data import LoaderSpec
    from distkit.data._stream_spec import StreamSpec
    from distkit.faults._preempt import Preemption
    from distkit.runtime._runtime import Runtime


@contextlib.contextmanager
def guarded(
    runtime: Runtime,
    *,
    fault_timeout: float | None,
    hang_warning: float | None,
    preempt: Preemption | None = None,
) -> Iterator[None]:
    """Run the block under ``runtime``'s fail-fast guard, as ``with rt:`` does, with the
    Trainer's timeouts and its preemption (see ``Runtime._guarded``)."""
    with runtime._guarded(fault_timeout=fault_timeout, hang_warning=hang_warning, preempt=preempt):
        yield


def loader_spec(
    runtime: Runtime, data: Any, what: str, *, batch_size: int, shuffle: bool, num_workers: int
) -> LoaderSpec | StreamSpec:
    """``data`` (a Dataset, a DataLoader or a stream) as what every rank will load, as
    ``rt.loader`` reads it."""
    return runtime._loader_spec(
        data, what, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers
    )


def renew_topology(runtime: Runtime) -> None:
    """Read the strategy's place again (an elastic group re-formed: new rank, new size)."""
    runtime._renew_topology()


def require_open(runtime: Runtime, call: str) -> None:
    """Raise :class:`~distkit.errors.TrainerClosedError` if ``runtime`` is closed, naming
    ``call``."""
    runtime._require_open(call)
