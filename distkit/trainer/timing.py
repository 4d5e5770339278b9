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

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PHASES = ("data", "forward", "backward", "optimizer")
_DEVICE_PHASES = ("forward", "backward", "optimizer")
#: above this share of the step, communication is named with its fixes. With a share s,
#: N processes train at most N x (1 - s) the samples/s of one: above 0.4, 2 processes give
#: less than 1.2x one, so most of the second is lost. 0.4 rather than the break-even 0.5:
#: on CPU the probe (idle cores) reads ~2/3 of what the all-reduce costs inside backward
COMM_HINT_SHARE = 0.4
#: above this share of the step, waiting for data is named with its fixes
DATA_HINT_SHARE = 0.3
#: CUDA: fold the finished events once this many are kept (3 per optimizer step)
FOLD_EVENTS = 768
_clock = time.perf_counter  # read a few times per step: a module global, not an attribute


def cores_per_process(local_processes: int) -> int:
    """The cores one training process and its loader workers can count on: this process's
    affinity, shared by the node's ``local_processes`` unless the launcher pinned each
    process to fewer cores than the machine has (then its own affinity is its share)."""
    if hasattr(os, "sched_getaffinity"):
        usable = len(os.sched_getaffinity(0)) or 1
    else:  # macOS, Windows: no affinity to read
        usable = os.cpu_count() or 1
    machine = os.cpu_count() or usable
    return usable if usable < machine else max(usable // max(local_processes, 1), 1)


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
        #: the waits for data so far; the first (the loader's workers starting, seconds
        #: with many workers) is kept apart from the data phase: it is no step's cost
        self.data_waits = 0
        self.first_wait = 0.0

    def start(self) -> None:
        """Begin the epoch (and the first wait for data)."""
        self._started = self._last = _clock()
        if self.cuda:
            self._open = self._record()

    def mark(self, phase: str) -> None:
        """End ``phase``: the time since the previous mark belongs to it."""
        now = _clock()
        if self.cuda:
            self._mark_cuda(phase, now)
        elif phase == "data":
            self._waited(now)
        else:  # the usual mark on CPU: one clock read and one sum (a few per step)
            totals = self.totals
            totals[phase] = totals.get(phase, 0.0) + (now - self._last)
        self._last = now

    def _waited(self, now: float) -> None:
        """A wait for data ended at ``now`` (host time on any device)."""
        self.data_waits += 1
        if self.data_waits == 1:
            self.first_wait = now - self._last
        else:
            self.totals["data"] += now - self._last

    def _mark_cuda(self, phase: str, now: float) -> None:
        if phase in _DEVICE_PHASES:
            end = self._record()
            assert self._open is not None
            self._events.append((phase, self._open, end))
            self._open = end
            if len(self._events) >= FOLD_EVENTS:
                self._fold_finished()
            return
        if phase == "data":
            self._waited(now)
        else:
            self.totals[phase] = self.totals.get(phase, 0.0) + (now - self._last)
        self._open = self._record()

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
        """``[data, forward, backward, optimizer, wall]`` seconds and ``steps`` for the epoch.

        The data phase counts every wait but the first at their mean (the first is the
        workers' start); an epoch of one batch has only the first to count."""
        if self._events:
            torch.cuda.synchronize()
            for phase, start, end in self._events:
                self.totals[phase] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        wall = _clock() - self._started
        waits = self.data_waits
        data = self.totals["data"] * waits / (waits - 1) if waits > 1 else self.first_wait
        values = [data] + [self.totals[p] for p in PHASES[1:]] + [wall, float(self.steps)]
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
    local_processes: int = 1  # training processes on the node of rank 0 (which reports)
    wall_s: float = 0.0  # the slowest rank's wall time for the epoch's training loop

    @classmethod
    def from_ranks(
        cls,
        per_rank: torch.Tensor | Sequence[Sequence[float]],
        global_samples: int,
        *,
        comm_ms: float = 0.0,
        comm_mb: float = 0.0,
        local_processes: int = 1,
    ) -> EpochTiming:
        """``per_rank``: one :meth:`StepTimer.summary` row per rank; ``comm_ms``: the
        gradients' all-reduce time (:func:`distkit.trainer._comm_probe.allreduce_ms`), ``comm_mb``
        their size; ``local_processes``: how many training processes share rank 0's node."""
        rows = per_rank.tolist() if isinstance(per_rank, torch.Tensor) else per_rank  # one read
        steps = max(rows[0][-1], 1.0)
        mean = [sum(column) / len(rows) for column in zip(*rows, strict=True)]
        step_ms = {p: mean[i] * 1000.0 / steps for i, p in enumerate(PHASES)}
        step_ms["step"] = sum(step_ms[p] for p in PHASES)
        work = [row[0] + row[1] for row in rows]
        slowest = work.index(max(work))  # the first of equals
        straggler = max(work) / min(work) if min(work) > 0 else 1.0
        wall = max(row[-2] for row in rows)
        return cls(
            step_ms=step_ms,
            samples_per_s=global_samples / wall if wall > 0 else 0.0,
            straggler=straggler,
            slowest_rank=slowest,
            data_share=step_ms["data"] / step_ms["step"] if step_ms["step"] > 0 else 0.0,
            world_size=len(rows),
            comm_ms=comm_ms,
            # the all-reduce is inside the step: a share of 1 or more says the probe, run
            # alone, does not measure what the step pays (a step of a few ms), and no
            # estimate is made from it (table)
            comm_share=comm_ms / step_ms["step"] if step_ms["step"] > 0 else 0.0,
            comm_mb=comm_mb,
            local_processes=local_processes,
            wall_s=wall,
        )

    def as_record(self) -> dict[str, float]:
        """Flat history entries (``time_*_ms``, ``time_comm_ms``, ``samples_per_s``,
        ``time_straggler``)."""
        record = {f"time_{phase}_ms": value for phase, value in self.step_ms.items()}
        record["time_comm_ms"] = self.comm_ms
        record["samples_per_s"] = self.samples_per_s
        record["time_straggler"] = self.straggler
        return record

    def table(self, comm_phase: str, num_workers: int, *, cores: int | None = None) -> str:
        """Two or three lines for the epoch summary, with advice when something stands out.

        ``cores``: the cores each training process may use (None: this machine's, by
        :func:`cores_per_process`); more loader workers are advised only where they fit.
        """
        names = {p: p for p in PHASES}
        if comm_phase in names:
            names[comm_phase] = f"{comm_phase}+allreduce"
        cells = " | ".join(f"{names[p]} {self.step_ms[p]:.1f}" for p in PHASES)
        ranks = f"; slowest rank {self.straggler:.2f}x fastest" if self.world_size > 1 else ""
        comm = ""
        # the probe runs alone, at the epoch's end; the step's all-reduce starts in backward
        # (DDP's and Horovod's hooks) and ends in the phase that waits for it (DDP: backward,
        # Horovod: the optimizer step). A probe that took longer than those phases timed
        # something the step did not pay (on shared cores: a descheduled rank, the loader's
        # workers shutting down), so nothing is estimated from it
        within = PHASES[2 : PHASES.index(comm_phase) + 1] if comm_phase in PHASES[2:] else PHASES
        bound = sum(self.step_ms[p] for p in within)
        measured = self.comm_ms < bound
        if self.comm_ms > 0:
            share = f"{self.comm_share:.0%} of the step" if measured else "the probe's, alone"
            comm = f" | allreduce ~{self.comm_ms:.1f} ms ({share})"
        lines = [
            f"  step {self.step_ms['step']:.1f} ms = {cells}{comm}  "
            f"({self.samples_per_s:,.0f} samples/s{ranks})"
        ]
        if self.comm_ms > 0 and not measured:
            where = " and ".join(names[p] for p in within) if within != PHASES else "the step"
            lines.append(
                f"  the all-reduce probe, run alone, took longer than {where} "
                f"({self.comm_ms:.1f} ms against {bound:.1f} ms), so it cannot "
                "say what communication costs the step: no estimate is made from it (on "
                "shared cores it also times a rank that waits for its turn)"
            )
        elif self.comm_share > COMM_HINT_SHARE:
            lines.append(self._comm_hint())
        if self.data_share > DATA_HINT_SHARE:
            lines.append(self._data_hint(num_workers, cores))
        if self.straggler > 1.2:
            lines.append(
                f"  rank {self.slowest_rank} is {self.straggler - 1:.0%} slower before the "
                "all-reduce and every rank waits for it: check what else runs on its device or "
                "cores, and its data (num_workers, slow samples)"
            )
        return "\n".join(lines)

    def _data_hint(self, num_workers: int, cores: int | None) -> str:
        """One sentence: data loading is slow; more workers only where cores are left."""
        per_process = cores_per_process(self.local_processes) if cores is None else cores
        start = f"  data loading takes {self.data_share:.0%} of each step"
        if num_workers + 2 <= per_process:  # the process itself, its workers, one more
            return (
                f"{start}: raise num_workers (now {num_workers}; {per_process} cores per "
                f"training process leave room for up to {per_process - 1}), make "
                "__getitem__ (a stream: its reading) cheaper, or use a larger batch_size"
            )
        here = (
            f"{self.local_processes} training processes on this node"
            if self.local_processes > 1
            else "one training process"
        )
        return (
            f"{start}, and more loader workers would not help: {per_process} "
            f"core{'s' if per_process > 1 else ''} per process ({here}) already run the "
            f"process and its num_workers={num_workers}: make __getitem__ (a stream: its "
            "reading) cheaper, or prepare the samples once, ahead of training"
        )

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
            f"  communication takes {self.comm_share:.0%} of each step ({_size(self.comm_mb)} "
            f"of gradients all-reduced per step), so {n} processes train at most ~{ceiling:.1f}x "
            f"the samples/s of one: a 2x per-process batch_size, grad_accum_steps=2 or fp16/bf16 "
            f'gradient compression (DDPStrategy(comm_hook="fp16"), HorovodStrategy('
            f'compression="fp16")) '
            f"would each give ~{gain(2):.1f}x the samples/s (4x batch or accumulation: "
            f"~{gain(4):.1f}x), and fewer processes lose less of each step to it"
        )


def _size(mb: float) -> str:
    """``21.2 MB``; below 0.1 MB in kB (a small model's gradients are not "0.0 MB")."""
    return f"{mb:.1f} MB" if mb >= 0.1 else f"{mb * 1000:.1f} kB"
