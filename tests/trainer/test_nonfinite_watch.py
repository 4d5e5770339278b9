"""nonfinite="raise"'s check: its part of a sum, the verdict on the summed parts, and the
check skipped where a previous one already read the same global step."""

from __future__ import annotations

import pytest
import torch

import distkit
from distkit.errors import NonFiniteLossError
from distkit.trainer._losses import LossLedger
from distkit.trainer._nonfinite import NonFiniteWatch


def _sum(*parts: list[float]) -> list[float]:
    return [sum(values) for values in zip(*parts, strict=True)]


def test_nonfinite_payload_puts_each_rank_in_its_own_slots():
    watch = NonFiniteWatch(enabled=True, every=50)
    assert watch.payload(None, 3, 1) == [0.0] * 9
    # step 7 (noted 0-based) travels as 8, "inf" as code 2, epoch 4
    assert watch.payload((4, 7, "inf"), 3, 1) == [0, 8, 0, 0, 2, 0, 0, 4, 0]


def test_nonfinite_verdict_names_the_first_bad_step_and_every_rank_that_saw_it():
    watch = NonFiniteWatch(enabled=True, every=10)
    summed = _sum(
        watch.payload((0, 12, "nan"), 3, 0),
        watch.payload(None, 3, 1),
        watch.payload((0, 12, "-inf"), 3, 2),
    )
    with pytest.raises(NonFiniteLossError, match=r"\(nan\) on ranks 0, 2 in epoch 0, step 13"):
        watch.verdict(summed, now=20)
    watch.verdict(_sum(watch.payload(None, 2, 0), watch.payload(None, 2, 1)), now=30)


def test_nonfinite_check_at_the_step_already_checked_reads_nothing():
    """A check point right after another at the same global step (the epoch's end after its
    last log point) has no loss to read: every rank is at that step and losses are noted only
    with a step, so every rank skips it alike."""
    from tests.support.host_syncs import StepSpans, counting

    runtime = distkit.Runtime(strategy="dp")
    strategy = runtime.strategy
    ledger = LossLedger(strategy.device, watch=True)
    watch = NonFiniteWatch(enabled=True, every=4)
    ledger.add_step([torch.tensor(1.0)], [1], epoch=0, step=0)
    watch.check(strategy, ledger, now=1)
    spans = StepSpans()
    with counting(spans):
        watch.check(strategy, ledger, now=1)
    assert spans.spans == [[]]
    assert not watch.due(1) and watch.due(2)
    assert not NonFiniteWatch(enabled=False, every=4).due(2)
    runtime.close()
