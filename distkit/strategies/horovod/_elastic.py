"""Horovod elastic: a fit's :class:`~distkit.runtime._snapshot.RunSnapshot` as Horovod's state.

Horovod's ``elastic.run`` calls ``sync()`` before each run of the training body (rank 0's
state to every process, new ones included), ``commit()`` at distkit's commit points (save,
then raise ``HostsUpdatedInterrupt`` if hosts changed) and ``restore()`` after a collective
failed half-way (a process died), before it re-forms the group and runs the body again.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def elastic_state(hvd: ModuleType, snapshot: Any, strategy: Any) -> Any:
    """A ``horovod.common.elastic.State`` that saves, restores and syncs ``snapshot``."""
    from horovod.common.elastic import State

    class DistkitState(State):
        def __init__(self) -> None:
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)

        def save(self) -> None:
            snapshot.save()

        def restore(self) -> None:
            snapshot.restore()

        def sync(self) -> None:
            snapshot.sync(strategy)

    return DistkitState()
