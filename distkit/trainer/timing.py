"""Where a training step's time goes: data, forward, backward, optimizer; and stragglers.

Always on: a mark costs one ``perf_counter`` call (well under a microsecond), a few per
step. On CUDA the compute phases are timed with CUDA events, since host time only measures
kernel launches; waiting for data is host time on any device.

Communication shows up where the backend does it: DDP and apex all-reduce during backward,
Horovod waits for its all-reduce in the optimizer step. Every rank waits for the slowest at
each all-reduce, so stragglers are found from the work before it (data + forward). How
much of a step the all-reduce itself takes is measured apart, by a probe once per epoch
(:mod:`distkit.trainer._comm_probe`): its share of the step says whether more processes can pay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

PHASES = ("data", "forward", "backward", "optimizer")
_DEVICE_PHASES = ("forward", "backward", "optimizer")
#: above this share of the step, communication is named with its fixes. With a share s,
#: N processes train at most N x (1 - s) the samples/s of one: above 0.4, 2 processes give
#: less than 1.2x one, so most of the second is lost. 0.4 rather than the break-even 0.5:
#: on CPU the probe (idle cores) reads ~2/3 of what the all-reduce costs inside backward
COMM_HINT_SHARE = 0.4
#: CUDA: fold the finished events once this many are kept (3 per optimizer step)
FOLD_EVENTS = 768


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
            if len(self._events) >= FOLD_EVENTS:
                self._fold_finished()
        else:
            self.totals[phase] = self.totals.get(phase, 0.0) + (now - self._last)
            if self.cuda:
                self._open = self._record()
        self._last = now

    def _fold_finished(self) -> None:
        """Add up the oldest events the GPU has passed (``query()`` does not wait), so that
        a long epoch keeps a bounded number of events without synchronising."""
        done = 0
        for phase, start, end in self._events:
            if not end.query():
                break
            self.totals[phase] += start.elapsed_time(end) / 1000.0
            done += 1
        del self._events[:done]

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
    comm_ms: float = 0.0  # one all-reduce of the gradients (the probe's; 0: none measured)
    comm_share: float = 0.0  # comm_ms / step time
    comm_mb: float = 0.0  # the gradients' size, all-reduced once per step

    @classmethod
    def from_ranks(
        cls,
        per_rank: torch.Tensor,
        global_samples: int,
        *,
        comm_ms: float = 0.0,
        comm_mb: float = 0.0,
    ) -> EpochTiming:
        """``per_rank``: one :meth:`StepTimer.summary` row per rank; ``comm_ms``: the
        gradients' all-reduce time (:func:`distkit.trainer._comm_probe.allreduce_ms`), ``comm_mb``
        their size."""
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
            comm_ms=comm_ms,
            # the all-reduce is inside the step (overlapped with backward or not): at most all
            comm_share=min(comm_ms / step_ms["step"], 1.0) if step_ms["step"] > 0 else 0.0,
            comm_mb=comm_mb,
        )

    def as_record(self) -> dict[str, float]:
        """Flat history entries (``time_*_ms``, ``time_comm_ms``, ``samples_per_s``,
        ``time_straggler``)."""
        record = {f"time_{phase}_ms": value for phase, value in self.step_ms.items()}
        record["time_comm_ms"] = self.comm_ms
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
        comm = ""
        if self.comm_ms > 0:
            comm = f" | allreduce ~{self.comm_ms:.1f} ms ({self.comm_share:.0%} of the step)"
        lines = [
            f"  step {self.step_ms['step']:.1f} ms = {cells}{comm}  "
            f"({self.samples_per_s:,.0f} samples/s{ranks})"
        ]
        if self.comm_share > COMM_HINT_SHARE:
            lines.append(self._comm_hint())
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

    def _comm_hint(self) -> str:
        """One sentence: communication dominates, the knobs, and what each would gain.

        The estimates take the step as compute plus the measured all-reduce, not overlapped,
        with compute growing linearly with the batch (on a GPU a larger batch often costs
        less than linearly, and DDP hides part of the all-reduce behind backward). Sending
        half the bytes gains what a 2x batch gains: both halve communication per sample.
        """
        step, comm, n = self.step_ms["step"], self.comm_ms, self.world_size
        compute = max(step - comm, 1e-9)
        ceiling = n * compute / step  # N processes' samples/s over one process's, at best

        def gain(k: int) -> float:  # samples/s with k x the samples per all-reduce
            return k * step / (k * compute + comm)

        return (
            f"  communication takes {self.comm_share:.0%} of each step ({self.comm_mb:.1f} MB "
            f"of gradients all-reduced per step), so {n} processes train at most ~{ceiling:.1f}x "
            f"the samples/s of one: a 2x per-process batch_size, grad_accum_steps=2 or fp16/bf16 "
            f'gradient compression (DDPStrategy(comm_hook="fp16"), HorovodStrategy('
            f'compression="fp16")) '
            f"would each give ~{gain(2):.1f}x the samples/s (4x batch or accumulation: "
            f"~{gain(4):.1f}x), and fewer processes lose less of each step to it"
        )
