"""Where a training step's time goes: data, forward, backward, optimizer; and stragglers.

Always on: a mark costs one ``perf_counter`` call (well under a microsecond), a few per
step. On CUDA the compute phases are timed with CUDA events, since host time only measures
kernel launches; waiting for data is host time on any device.

Communication shows up where the backend does it: DDP and apex all-reduce during backward,
Horovod waits for its all-reduce in the optimizer step. Every rank waits for the slowest at
each all-reduce, so stragglers are found from the work before it (data + forward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

PHASES = ("data", "forward", "backward", "optimizer")
_DEVICE_PHASES = ("forward", "backward", "optimizer")


class StepTimer:
    """Accumulates per-phase time over one epoch on one rank."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.samples = 0
        self._last = 0.0
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: torch.cuda.Event | None = None
        self._started = 0.0

    def start(self) -> None:
        """Begin the epoch (and the first wait for data)."""
        self._started = self._last = time.perf_counter()
        if self.cuda:
            self._open = self._record()

    def mark(self, phase: str) -> None:
        """End ``phase``: the time since the previous mark belongs to it."""
        now = time.perf_counter()
        if self.cuda and phase in _DEVICE_PHASES:
            end = self._record()
            assert self._open is not None
            self._events.append((phase, self._open, end))
            self._open = end
        else:
            self.totals[phase] = self.totals.get(phase, 0.0) + (now - self._last)
            if self.cuda:
                self._open = self._record()
        self._last = now

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def summary(self) -> torch.Tensor:
        """``[data, forward, backward, optimizer, wall]`` seconds and ``steps`` for the epoch."""
        if self._events:
            torch.cuda.synchronize()
            for phase, start, end in self._events:
                self.totals[phase] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        wall = time.perf_counter() - self._started
        values = [self.totals[p] for p in PHASES] + [wall, float(self.steps)]
        return torch.tensor(values, dtype=torch.float64)


@dataclass(frozen=True)
class EpochTiming:
    """An epoch's timing over all ranks (the same on every rank)."""

    step_ms: dict[str, float]  # mean over ranks, per optimizer step, per phase
    samples_per_s: float
    straggler: float  # slowest rank's data+forward time / the fastest's
    slowest_rank: int
    data_share: float  # data wait / step time
    world_size: int

    @classmethod
    def from_ranks(cls, per_rank: torch.Tensor, global_samples: int) -> EpochTiming:
        """``per_rank``: one :meth:`StepTimer.summary` row per rank."""
        steps = max(float(per_rank[0, -1]), 1.0)
        mean = per_rank.mean(dim=0)
        step_ms = {p: float(mean[i]) * 1000.0 / steps for i, p in enumerate(PHASES)}
        step_ms["step"] = sum(step_ms[p] for p in PHASES)
        work = per_rank[:, 0] + per_rank[:, 1]
        slowest = int(work.argmax())
        straggler = float(work.max() / work.min()) if float(work.min()) > 0 else 1.0
        wall = float(per_rank[:, -2].max())
        return cls(
            step_ms=step_ms,
            samples_per_s=global_samples / wall if wall > 0 else 0.0,
            straggler=straggler,
            slowest_rank=slowest,
            data_share=step_ms["data"] / step_ms["step"] if step_ms["step"] > 0 else 0.0,
            world_size=int(per_rank.shape[0]),
        )

    def as_record(self) -> dict[str, float]:
        """Flat history entries (``time_*_ms``, ``samples_per_s``, ``time_straggler``)."""
        record = {f"time_{phase}_ms": value for phase, value in self.step_ms.items()}
        record["samples_per_s"] = self.samples_per_s
        record["time_straggler"] = self.straggler
        return record

    def table(self, comm_phase: str, num_workers: int) -> str:
        """Two or three lines for the epoch summary, with advice when something stands out."""
        names = {p: p for p in PHASES}
        if comm_phase in names:
            names[comm_phase] = f"{comm_phase}+allreduce"
        cells = " | ".join(f"{names[p]} {self.step_ms[p]:.1f}" for p in PHASES)
        ranks = f"; slowest rank {self.straggler:.2f}x fastest" if self.world_size > 1 else ""
        lines = [
            f"  step {self.step_ms['step']:.1f} ms = {cells}  "
            f"({self.samples_per_s:,.0f} samples/s{ranks})"
        ]
        if self.data_share > 0.3:
            lines.append(
                f"  data loading takes {self.data_share:.0%} of each step: raise num_workers "
                f"(now {num_workers}), make __getitem__ (a stream: its reading) cheaper, or use "
                "a larger batch_size"
            )
        if self.straggler > 1.2:
            lines.append(
                f"  rank {self.slowest_rank} is {self.straggler - 1:.0%} slower before the "
                "all-reduce and every rank waits for it: check what else runs on its device or "
                "cores, and its data (num_workers, slow samples)"
            )
        return "\n".join(lines)
