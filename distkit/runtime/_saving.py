"""Writing a trainer's checkpoints: every rank takes part, rank 0 writes.

The payload is a collective (every rank's RNG state is gathered, a sharded model's state is
gathered or written by every rank); the write happens on rank 0, and every rank learns how
it went, so no rank goes on while rank 0 is still writing or after its write failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distkit import checkpoint as ckpt
from distkit.runtime import _agreement, _resume
from distkit.runtime._preparation import prepare_save
from distkit.strategies.base import Strategy

if TYPE_CHECKING:
    from distkit.runtime._fit_state import Stateful
    from distkit.runtime._resume import LatestFit


def save_to(
    strategy: Strategy,
    run: LatestFit | None,
    callbacks: Stateful,
    path: str | os.PathLike[str],
    extra: dict[str, Any] | None,
) -> None:
    """``trainer.save_checkpoint(path, extra)``: the latest fit's ``run``, written atomically."""
    payload = _payload(strategy, run, callbacks, extra, path)
    write = lambda ready: ckpt.atomic_save(ready, Path(path))  # noqa: E731
    write_on_rank_zero(strategy, payload, write)


def save_to_folder(
    strategy: Strategy, run: LatestFit, callbacks: Stateful, folder: ckpt.CheckpointFolder
) -> None:
    """``run`` into ``checkpoint_dir`` as ``step-<global step>.pt`` (keeping the last K)."""
    step = run.state.global_step
    payload = _payload(strategy, run, callbacks, None, folder.path_for(step))
    write_on_rank_zero(strategy, payload, lambda ready: folder.save(ready, step))


def _payload(
    strategy: Strategy,
    run: LatestFit | None,
    callbacks: Stateful,
    extra: dict[str, Any] | None,
    path: str | os.PathLike[str],
) -> dict[str, Any] | None:
    """The checkpoint on rank 0 (None elsewhere): a collective that every rank joins."""
    callback_states, ranks = _agreement.exchange(
        strategy, "save_checkpoint", lambda: prepare_save(strategy, run, callbacks, extra, path)
    )
    assert run is not None  # prepare_save refused a missing run on every rank
    # every rank: gathering (or writing) a sharded model's state is a collective
    states = strategy.state_io.checkpoint_state(run.model, run.optimizer, Path(path))
    if not strategy.is_main:
        return None
    payload = _resume.build_payload(strategy, run, extra, ranks, states)
    payload["callbacks"] = callback_states
    return payload


def write_on_rank_zero(
    strategy: Strategy, payload: dict[str, Any] | None, write: Callable[[dict[str, Any]], object]
) -> None:
    """Rank 0 writes ``payload``; then every rank learns how that went (a broadcast).

    So a failed write fails every rank, and no rank goes on to read the folder (a next
    ``fit`` with ``resume="auto"``) while rank 0 is still writing to it. It costs no time:
    the other ranks would wait for rank 0 at their next collective anyway.
    """
    failure = None
    if payload is not None:
        try:
            write(payload)
        except Exception as exc:
            failure = exc
    share_outcome(strategy, failure, "the checkpoint")


def share_outcome(strategy: Strategy, failure: Exception | None, what: str) -> None:
    """After rank 0 wrote ``what`` (``failure``: how it failed there, None on the others or
    when it worked), every rank learns how that went, in one broadcast: rank 0 raises its
    error, the others a CheckpointError naming it; where it worked, all return."""
    outcome = strategy.broadcast(
        None if failure is None else f"{type(failure).__name__}: {failure}", src=0
    )
    if failure is not None:
        raise failure
    if outcome is not None:
        raise ckpt.CheckpointError(f"rank 0 could not write {what}: {outcome}")
