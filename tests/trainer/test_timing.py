"""The step-time breakdown: phases add up, stragglers and slow data are named with the fix."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import distkit
from distkit.trainer.timing import PHASES, EpochTiming

pytestmark = pytest.mark.timeout(120)


class _SlowData(Dataset):
    """Each sample takes ``delay`` seconds to load (on the ranks listed in ``slow_ranks``)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return self.x[i], self.x[i].sum(0, keepdim=True)


def _fit(delay: float, slow_rank: int | None = None) -> dict:
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False)
    is_slow = slow_rank is None or trainer.rank == slow_rank
    model = nn.Linear(4, 1)
    data = _SlowData(32, delay if is_slow else 0.0)
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                         loss_fn=nn.functional.mse_loss)  # fmt: skip
    trainer.close()
    return result.history[0]


def test_timing_phases_add_up_and_slow_data_shows_as_data_time(run_on_ranks):
    record = run_on_ranks(_fit, 0.002, world_size=1)[0]
    phases = [record[f"time_{p}_ms"] for p in PHASES]
    assert record["time_step_ms"] == pytest.approx(sum(phases))
    assert record["time_data_ms"] > 4 * 2.0 * 0.9  # 4 samples x 2 ms of loading per step
    assert record["samples_per_s"] > 0


def test_timing_names_the_straggling_rank(run_on_ranks):
    # 20 ms a sample on rank 1 (80 ms a step) against a step's few ms of other work: the ratio
    # stays far above 2 on a loaded machine (at 3 ms a sample, 3 pytest workers on 2 cores
    # brought it down to 1.7: the fast rank's own work grows with the load, the sleep does not)
    records = run_on_ranks(_fit, 0.02, 1, world_size=2)
    assert records[0] == records[1], "timing must be the same dict on every rank"
    assert records[0]["time_straggler"] > 2.0


def test_timing_table_gives_advice_for_data_and_stragglers():
    per_rank = torch.tensor(
        [[8.0, 1.0, 1.0, 1.0, 12.0, 10.0], [2.0, 1.0, 7.0, 1.0, 12.0, 10.0]], dtype=torch.float64
    )
    timing = EpochTiming.from_ranks(per_rank, global_samples=640)
    assert timing.slowest_rank == 0 and timing.straggler == pytest.approx(9.0 / 3.0)
    text = timing.table("backward", num_workers=0)
    assert "backward+allreduce" in text and "53 samples/s" in text
    assert "raise num_workers (now 0)" in text
    assert "rank 0 is 200% slower" in text


class _FakeEvent:
    """Stands in for torch.cuda.Event (no CUDA here): a fake-based test, as the docstring of
    the test says. ``done`` is whether the GPU has passed it; ``at`` its time in ms."""

    clock = 0.0
    pending: list[_FakeEvent] = []

    def __init__(self, enable_timing: bool = True) -> None:
        self.at = 0.0
        self.done = False

    def record(self) -> None:
        _FakeEvent.clock += 1.0
        self.at = _FakeEvent.clock
        _FakeEvent.pending.append(self)

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.done and end.done, "elapsed_time on an event the GPU has not passed waits"
        return end.at - self.at


def test_timing_cuda_events_are_folded_as_the_gpu_passes_them(monkeypatch):
    """Fake CUDA events (there is no GPU here): a long epoch keeps a bounded number of events,
    folding only those the GPU has passed (query(), which never waits), and the totals are
    the same as reading them all at the end."""
    from distkit.trainer import timing

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "FOLD_EVENTS", 30)
    _FakeEvent.clock, _FakeEvent.pending = 0.0, []
    timer = timing.StepTimer(torch.device("cuda", 0))
    timer.start()
    for _ in range(100):
        for phase in ("data", "forward", "backward", "optimizer"):
            timer.mark(phase)
        timer.steps += 1
        # the GPU runs 5 steps behind the host
        for event in _FakeEvent.pending[: max(0, len(_FakeEvent.pending) - 20)]:
            event.done = True
        assert len(timer._events) <= 30 + 3
    for event in _FakeEvent.pending:
        event.done = True  # what synchronize() would have waited for
    summary = timer.summary()
    # each device phase spans one clock tick per step: forward, backward, optimizer
    assert summary[1:4].tolist() == pytest.approx([0.1, 0.1, 0.1])
