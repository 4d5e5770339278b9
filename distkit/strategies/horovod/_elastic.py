"""Horovod elastic: a fit's :class:`~distkit.trainer._snapshot.RunSnapshot` as Horovod's state.

Horovod's ``elastic.run`` calls ``sync()`` before each run of the training body (rank 0's
state to every process, new ones included), ``commit()`` at distkit's commit points (save,
then raise ``HostsUpdatedInterrupt`` if hosts changed) and ``restore()`` after a collective
failed half-way (a process died), before it re-forms the group and runs the body again.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from typing_extensions import override

from distkit.strategies.capabilities import Elastic


class HorovodElastic(Elastic):
    """Horovod elastic's retry loop around a fit's epochs (``horovodrun --min-np/--max-np``).

    Args:
        hvd: the ``horovod.torch`` module.
        strategy: the Horovod strategy (synced snapshots broadcast through it).
        on_reset: called after Horovod re-formed the group (the strategy re-reads its rank
            and size).
    """

    def __init__(self, hvd: ModuleType, strategy: Any, on_reset: Callable[[], None]) -> None:
        self._hvd = hvd
        self._strategy = strategy
        self._on_reset = on_reset
        self._state: Any = None  # the running fit's, between commits

    @override
    def run(self, body: Callable[[], None], snapshot: Any) -> None:
        state = elastic_state(self._hvd, snapshot, self._strategy)
        state.register_reset_callbacks([self._on_reset])
        self._state = state
        try:
            self._hvd.elastic.run(lambda _state: body())(state)
        finally:
            self._state = None

    @override
    def commit(self) -> None:
        if self._state is not None:
            # saves the run in memory; raises HostsUpdatedInterrupt when hosts changed, which
            # run()'s loop turns into a re-formed group and a new run of the body
            self._state.commit()


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
