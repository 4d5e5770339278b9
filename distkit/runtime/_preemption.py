"""Preemption in a user's own loop: ``Runtime(preempt_signals=...)``, ``rt.preempted()``.

Inside ``with rt:`` the runtime's signals are noted, not raised (see
:mod:`distkit.faults._preempt`). The loop asks ``rt.preempted()`` once per optimizer step,
after ``optimizer.step()``, on every rank; it returns True on every rank at the same call,
the step the ranks agreed on. The loop then saves (``rt.save``) and calls
``rt.finish_preemption(path)``, which prints the timeline, runs the signal's previous handler,
requeues (``requeue=True``, rank 0) and raises :class:`~distkit.errors.TrainingPreempted`.
"""

from __future__ import annotations

import os
import time
from typing import NoReturn

from distkit.errors import ConfigurationError, RankDisagreementError
from distkit.faults._preempt import Preemption, Stop, finish
from distkit.runtime._call_tags import tagged_sum
from distkit.strategies.base import Strategy


def agreed_stop(preempt: Preemption, strategy: Strategy, step: int, *, why: str) -> Stop:
    """Every rank says the agreed step is here: check that it is the same step on every rank
    (one host-side sum), and return what they stopped for. ``why``: the likely cause of a
    mismatch, for the error every rank then raises."""
    (total,) = tagged_sum(strategy, "preempt", [float(step)])
    if total != step * strategy.world_size:
        raise RankDisagreementError(
            f"preemption: the ranks stopped after different steps (this rank after {step}, "
            f"their steps sum to {total:g} over {strategy.world_size} ranks): {why}; pass "
            "preempt_signals=() to have these signals stop the job at once instead"
        )
    return preempt.stop(step)


class LoopPreemption:
    """One ``with rt:`` block's preemption: the calls to ``rt.preempted()`` are its steps."""

    def __init__(self, preempt: Preemption) -> None:
        self.preempt = preempt
        self.steps = 0
        self.stop: Stop | None = None

    def preempted(self, strategy: Strategy) -> bool:
        """One step boundary: True on every rank at the agreed one (and at every call after)."""
        if self.stop is not None:
            return True
        self.steps += 1
        if not self.preempt.due(self.steps):
            return False
        self.stop = agreed_stop(
            self.preempt,
            strategy,
            self.steps,
            why="rt.preempted() was not called exactly once per optimizer step on every rank",
        )
        return True

    def finish(self, rank: int, checkpoint: str | os.PathLike[str] | None) -> NoReturn:
        if self.stop is None:
            raise ConfigurationError(
                "rt.finish_preemption() before rt.preempted() returned True: call it once "
                "the ranks agreed to stop and the run is saved"
            )
        self.stop.saved_at = time.time()
        self.stop.checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        finish(
            self.preempt,
            self.stop,
            rank=rank,
            resume="and rt.load that checkpoint before the loop (rt.load(path, state))",
        )
