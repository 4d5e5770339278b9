"""The loss ledger: losses noted per step without tensor work, summed exactly when folded."""

from __future__ import annotations

import math

import torch

from distkit.trainer import _losses
from distkit.trainer._losses import LossLedger, step_mean


def _ledger(watch: bool = True) -> LossLedger:
    ledger = LossLedger(torch.device("cpu"), watch=watch)
    ledger.begin_epoch(0.0)
    return ledger


def test_losses_fold_sums_loss_times_count_in_float64():
    ledger = _ledger()
    steps = [([0.5, 0.25], [3, 1]), ([1.0 / 3.0], [7]), ([2.0, 4.0, 8.0], [1, 2, 3])]
    for step, (values, counts) in enumerate(steps):
        losses = [torch.tensor(v, dtype=torch.float32) for v in values]
        ledger.add_step(losses, counts, epoch=0, step=step)
    expected = math.fsum(
        float(torch.tensor(v, dtype=torch.float32)) * c
        for values, counts in steps
        for v, c in zip(values, counts, strict=True)
    )
    assert float(ledger.epoch_sum) == 0.0  # nothing is summed before a fold
    ledger.fold()
    assert abs(float(ledger.epoch_sum) - expected) < 1e-12
    total, samples, found = ledger.read_window(17)
    assert abs(total - expected) < 1e-12 and (samples, found) == (17.0, None)
    assert ledger.read_window(0) == (0.0, 0.0, None)  # a new window starts from zero
    assert ledger.first_nonfinite() is None


def test_losses_mixed_dtypes_and_a_resumed_epoch_total():
    ledger = LossLedger(torch.device("cpu"), watch=False)
    total = ledger.begin_epoch(10.0)
    ledger.add_step([torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(2.0)], [2, 2], 0, 0)
    ledger.fold()
    assert float(total) == 10.0 + 1.5 * 2 + 2.0 * 2  # begin_epoch's tensor is the total
    assert ledger.first_nonfinite() is None  # no watch: nothing kept


def test_losses_fold_on_their_own_every_fold_every_losses(monkeypatch):
    monkeypatch.setattr(_losses, "FOLD_EVERY", 4)
    ledger = _ledger()
    for step in range(3):
        ledger.add_step([torch.tensor(1.0), torch.tensor(1.0)], [1, 1], 0, step)
    # folded once, at 4 noted losses; the last step's two wait for the next fold
    assert float(ledger.epoch_sum) == 4.0
    ledger.fold()
    assert float(ledger.epoch_sum) == 6.0


def test_losses_first_nonfinite_names_the_first_bad_step_across_folds():
    ledger = _ledger()
    ledger.add_step([torch.tensor(1.0)], [2], epoch=3, step=7)
    ledger.fold()
    ledger.add_step([torch.tensor(1.0), torch.tensor(float("-inf"))], [2, 2], epoch=3, step=8)
    ledger.add_step([torch.tensor(float("nan"))], [2], epoch=3, step=9)
    assert ledger.first_nonfinite() == (3, 8, "-inf")
    assert ledger.first_nonfinite() is None  # read once; the next check starts afresh


def test_losses_read_window_reads_the_host_once_for_total_count_and_bad_step():
    """A log point's numbers (the window's total, a device count, the first non-finite loss)
    come from one host read: the counter sees one tolist and nothing else."""
    from tests.support.host_syncs import StepSpans, counting

    ledger = _ledger()
    ledger.add_step([torch.tensor(1.0), torch.tensor(2.0)], [2, 2], epoch=0, step=0)
    ledger.add_step([torch.tensor(float("inf"))], [1], epoch=0, step=1)
    spans = StepSpans()
    with counting(spans):
        total, samples, found = ledger.read_window(torch.tensor(5))
    assert [read.split(" at ")[0] for read in spans.spans[0]] == ["tolist"]
    assert total == math.inf and samples == 5.0 and found == (0, 1, "inf")
    assert ledger.read_window(0) == (0.0, 0.0, None)
    # without the watch nothing is kept to scan, and the total is still read
    quiet = _ledger(watch=False)
    quiet.add_step([torch.tensor(float("nan"))], [3], epoch=0, step=0)
    total, samples, found = quiet.read_window(3)
    assert math.isnan(total) and samples == 3.0 and found is None


def test_losses_step_mean_is_the_step_loss_over_its_samples():
    mean = step_mean([torch.tensor(0.5), torch.tensor(2.0)], [3, 1], 4)
    assert mean.dtype == torch.float64
    assert float(mean) == (0.5 * 3 + 2.0 * 1) / 4
