"""Rank 0 writes, and every rank learns how it went: checkpoints and weights files.

No rank goes on while rank 0 is still writing, or after its write failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distkit import checkpoint as ckpt
from distkit.strategies.base import Strategy


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
