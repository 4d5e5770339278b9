"""One epoch of training: micro-batches, accumulation, optimizer steps. Strategy hooks only."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from tqdm.auto import tqdm

from distkit.batch import split_batch
from distkit.data import MicroBatch
from distkit.errors import ConfigurationError
from distkit.errors import NonFiniteLossError as NonFiniteLossError  # its old home
from distkit.faults._progress import Progress
from distkit.runtime import (
    ProfileRun,
    Runtime,
    RuntimeLoader,
    SetUpModel,
    SetUpOptimizer,
    training_loss,
)
from distkit.strategies._legacy_hooks import takes_before_step
from distkit.strategies._placement import Placement, follow_output
from distkit.strategies._steps import GradientClip, StepOutcome
from distkit.strategies.base import Strategy
from distkit.trainer import _comm_probe, _memory
from distkit.trainer._fit_call import StepFn
from distkit.trainer._fit_state import FitState as FitState  # its old home
from distkit.trainer._losses import LossLedger
from distkit.trainer._nonfinite import NonFiniteWatch
from distkit.trainer._phases import Phases
from distkit.trainer._pipeline_steps import pipeline_inputs, pipeline_loss
from distkit.trainer._throughput import (
    Peak,
    RateWindow,
    count_flops,
    device_peak,
    matmul_kind,
    rates_text,
    throughput_record,
)
from distkit.trainer.timing import EpochTiming, StepTimer

#: the context of a micro-batch that needs none (reusable: it holds no state)
_NOTHING = contextlib.nullcontext()

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


#: How :meth:`StepLoop.run_epoch` ended: "ended" (the epoch's data ran out), "stopped"
#: (``after_step`` stopped it with data left), "stopped-at-end" (stopped at the epoch's last
#: step: max_steps or should_stop there still gives the epoch its end).
EpochEnd = Literal["ended", "stopped", "stopped-at-end"]


@dataclass(frozen=True)
class StepLoopSettings:
    """The trainer's settings that one epoch of training reads."""

    max_epochs: int
    seed: int
    nonfinite: str  # "raise" or "skip"
    step_scheduler: bool  # step the LR scheduler after every optimizer step
    progress: bool  # a progress bar on rank 0 (on a terminal)
    clip: GradientClip | None = None  # clip the averaged, unscaled gradients before a step


class StepResult(NamedTuple):
    """What one optimizer step did, as this rank saw it (device values stay on the device).
    (A named tuple: one is made per step, at a tuple's cost.)"""

    losses: list[torch.Tensor]  # the batch-mean losses of its counted micro-batches
    #: what each mean is over: their real samples (this rank's), or a token-exact loss's items
    counts: list[int | torch.Tensor]
    samples: int  # this rank's real samples in the step
    #: the step's sum of ``counts`` (its samples, or its items: a device tensor where the
    #: counts were)
    items: int | torch.Tensor
    outcome: StepOutcome
    grad_norm: torch.Tensor | None  # total norm of the averaged gradients before clipping


class _StepSums:
    """One optimizer step's counted micro-batches, as :class:`StepResult` reports them
    (a plain class with slots: one is made per step)."""

    __slots__ = ("counts", "items", "losses", "samples", "skip_nonfinite", "token_exact")

    def __init__(self, skip_nonfinite: bool) -> None:
        self.skip_nonfinite = skip_nonfinite
        self.losses: list[torch.Tensor] = []
        self.counts: list[int | torch.Tensor] = []
        self.samples = 0
        self.items: int | torch.Tensor = 0
        self.token_exact = False  # a micro-batch's loss was a Loss(total, count)

    def add(self, loss: torch.Tensor, counted: int, items: int | torch.Tensor | None) -> None:
        # "skip" reads the loss here (its step reads the gradients anyway); "raise" reads
        # the noted losses at the next check point: no host sync
        if self.skip_nonfinite and counted and not torch.isfinite(loss):
            counted = 0  # its step is skipped: keep it out of the epoch's mean loss
        if items is not None:
            self.token_exact = True
        if counted:
            self.losses.append(loss.detach())
            weight = counted if items is None else items
            self.counts.append(weight)
            self.samples += counted
            self.items = self.items + weight

    def result(self, outcome: StepOutcome, norm: torch.Tensor | None) -> StepResult:
        return StepResult(self.losses, self.counts, self.samples, self.items, outcome, norm)


@dataclass(kw_only=True)
class StepLoop:
    """Everything one ``fit`` trains with; :meth:`run_epoch` trains one (partial) epoch."""

    runtime: Runtime  # the loop runs over it: its backward, set-up model and optimizer
    model: SetUpModel  # the fit's model as the runtime set it up (compiled forward inside)
    optimizer: SetUpOptimizer  # the fit's optimizer as the runtime set it up
    loader: RuntimeLoader  # the fit's batches (over the feed) on the input device
    loss_fn: LossFn | None
    step_fn: StepFn | None
    scheduler: Any
    settings: StepLoopSettings
    #: where the model is: each batch goes to its input device, and where the user placed
    #: the model on devices of their own, targets follow the output (see _placement)
    placement: Placement
    rank_progress: Progress = field(default_factory=Progress)  # read by the watchdog thread
    timer: StepTimer | None = None  # the current epoch's
    timing: EpochTiming | None = None  # the last finished epoch's, over all ranks
    #: the training losses, summed at check points (see _losses); EpochLoop folds and reads them
    losses: LossLedger
    #: ``nonfinite="raise"``'s check of the noted losses, at EpochLoop's check points
    watch: NonFiniteWatch = field(default_factory=lambda: NonFiniteWatch(enabled=False, every=1))
    #: the callbacks' ``on_before_optimizer_step``, run by the strategy's step on the final
    #: gradients; None when no callback overrides it: the step then finalizes nothing early
    before_step: Callable[[], None] | None = None
    #: the fit's profiler on this rank (None: off, and no range is opened)
    profile: ProfileRun | None = None
    #: run once on the first batch's (output, target) with ``loss_fn``: what validation
    #: will hand its metrics, refused before any step rather than after an epoch
    output_check: Callable[[Any, Any], None] | None = None
    #: count the model's FLOPs on the fit's first micro-batch with samples (off for a
    #: compiled forward: torch's counter cannot see inside a compiled graph)
    count_flops: bool = True
    #: this rank's FLOPs per sample (forward and backward), once counted (see _throughput)
    flops_per_sample: float | None = None
    token_exact: bool = False  # the fit's losses are token-exact (its epochs get tokens/s)
    peak: Peak | None = None  # the device's matmul peak (None: not known), found once
    _peak_found: bool = False
    #: the throughput between log points, for the progress bar
    rates: RateWindow = field(default_factory=RateWindow)
    _bar: tqdm[Any] | None = None  # the current epoch's progress bar
    pipeline: Any = field(init=False, repr=False, default=None)
    #: the micro-batch's forward and backward: counted once, then plain (see __post_init__)
    step_micro: Callable[[Any, MicroBatch, Phases], tuple[torch.Tensor, Any]] = field(
        init=False, repr=False
    )

    @property
    def strategy(self) -> Strategy:
        return self.runtime.strategy

    def __post_init__(self) -> None:
        counted = self.count_flops and self.flops_per_sample is None
        self.step_micro = self._counted_forward_backward if counted else self._forward_backward
        #: the schedule that runs each batch's forward and backward, where the model is a
        #: pipeline's (see Strategy.pipeline_of)
        self.pipeline = self.strategy.pipeline_of(self.model.wrapped)
        if self.pipeline is not None:
            self.output_check = None  # the outputs are the last stage's alone
        if self.before_step is not None and not takes_before_step(self.strategy):
            # every rank holds the same strategy class: all raise here, before any step
            name = type(self.strategy).__qualname__
            raise ConfigurationError(
                f"a callback overrides on_before_optimizer_step, but {name}.step(optimizer, "
                "clip=..., skip_nonfinite=...) takes no before_step, so it cannot run on the "
                f"step's final gradients. Add the keyword to {name}.step and call "
                "before_step() once the gradients are averaged and unscaled, before "
                "clipping (see Strategy.step), or drop that callback"
            )

    def run_epoch(
        self, state: FitState, after_step: Callable[[FitState, StepResult], bool]
    ) -> EpochEnd:
        """Train from ``state.position`` to the end of ``state.epoch``.

        ``after_step(state, result)`` runs after every optimizer step; True stops early.
        Returns how the epoch ended (see :data:`EpochEnd`).
        """
        loop, model, optimizer = self.runtime.loop, self.model, self.optimizer
        model.train()
        # the losses stay on the device, summed at check points: no tensor op per step
        state.loss_sum = self.losses.begin_epoch(float(state.loss_sum))
        state.ledger = self.losses
        sums = _StepSums(skip_nonfinite=self.settings.nonfinite == "skip")
        loader = self.loader.resume_at(state.epoch, state.position, state.local_position)
        left = loader.remaining()  # None: a stream, whose length is not known
        stopped, fresh_step = False, True  # fresh: the next micro-batch starts a step
        start_position, taken = state.position, 0  # taken: this rank's micro-batches so far
        timer, phases = self._start_timing(state)
        with self._new_bar(state, left) as bar, contextlib.closing(iter(loader)) as batches:
            self._bar = bar
            for batch in batches:
                taken += 1
                micro = loop.micro  # the batch's micro-batch: its weight, its window's end
                assert micro is not None
                phases.enter("forward")
                if fresh_step:
                    # freed here, before forward, as a hand-written loop does: freed right
                    # after the step instead, with the step's activations, the allocator
                    # hands the memory back to the OS and page-faults it in again each step
                    # (measured: ~8% slower steps of the benchmarks' CNN on CPU)
                    optimizer.clear()
                    fresh_step = False
                loss, items = self.step_micro(batch, micro, phases)
                phases.leave()
                sums.add(loss, micro.count, items)
                state.position += micro.samples
                if state.local_position is not None:
                    state.local_position += micro.count
                bar.update()
                if micro.last_in_step:
                    stopped = self._optimizer_step(state, sums, phases, after_step)
                    sums, fresh_step = _StepSums(skip_nonfinite=sums.skip_nonfinite), True
                    if stopped:
                        break
                phases.enter("data")
        phases.close()
        self._bar = None
        timer.samples = state.position - start_position
        optimizer.clear()  # no gradients held through validation and checkpoints
        if not stopped:
            return "ended"
        # every rank stops at the same step; with a known length each knows whether it was
        # the epoch's last (a stream's end is found only by reading on: "stopped")
        return "stopped-at-end" if left is not None and taken >= left else "stopped"

    def _start_timing(self, state: FitState) -> tuple[StepTimer, Phases]:
        """The epoch's timer, started, and its phases, in "data"; the memory peak reset and
        the throughput window opened at the same point."""
        progress = self.rank_progress
        progress.epoch, progress.step = state.epoch, state.global_step
        if self.count_flops:
            self._device_peak()  # once, before any timing or memory peak: a CPU's is measured
        timer = self.timer = StepTimer(self.strategy.device)
        _memory.reset_peak(self.strategy.device)  # the epoch's peak, read by epoch_record
        timer.start()
        self.rates.open(state.position, state.global_step)
        phases = Phases(progress, timer, None if self.profile is None else self.profile.ranges)
        phases.enter("data")
        return timer, phases

    def _optimizer_step(
        self,
        state: FitState,
        sums: _StepSums,
        phases: Phases,
        after_step: Callable[[FitState, StepResult], bool],
    ) -> bool:
        """The window's optimizer step, then ``after_step`` (True: stop)."""
        phases.enter("optimizer")
        self.token_exact = self.token_exact or sums.token_exact
        self.losses.add_step(sums.losses, sums.counts, state.epoch, state.global_step)
        outcome, norm = self._step(state)
        state.samples = state.samples + sums.items
        phases.leave()
        assert self.timer is not None
        self.timer.steps += 1
        self.rank_progress.step = state.global_step
        stopped = after_step(state, sums.result(outcome, norm))
        if self.profile is not None:
            self.profile.step()  # the step's callbacks and logs count in its window
        phases.leave("other")  # checkpoints: not part of a step
        return stopped

    def log_point(self, state: FitState, loss: float, items: float) -> None:
        """A log point on the progress bar: the loss since the last one and the throughput
        over the same steps (see :class:`RateWindow`; ``items``: the window's samples or
        token-exact items, summed over ranks). Nothing without a bar drawn."""
        bar = self._bar
        if bar is None or bar.disable:
            return
        _, peak = self._flops_and_peak()
        flops = self.flops_per_sample
        if flops is not None:  # this rank's count of its part: a tensor-parallel group's
            # ranks each compute an equal part of a sample (the epoch record sums them)
            flops *= self.strategy.world_size / self.strategy.data_world_size
        rates = self.rates.close(
            position=state.position,
            global_step=state.global_step,
            items=items if self.token_exact else None,
            flops_per_sample=flops,
            peak_sum=peak * self.strategy.world_size,
        )
        # the whole postfix replaced: a window without figures shows none, not stale ones
        # (an ordered dict: keywords tqdm would sort)
        bar.set_postfix(ordered_dict={"loss": f"{loss:.4g}", **rates_text(rates)})

    def _new_bar(self, state: FitState, left: int | None) -> tqdm[Any]:
        return tqdm(
            total=left,
            desc=f"epoch {state.epoch + 1}/{self.settings.max_epochs}",
            # a bar only where a person watches: piped output (CI, horovodrun) gets epoch lines
            disable=not (self.settings.progress and self.strategy.is_main and sys.stderr.isatty()),
            leave=False,
            dynamic_ncols=True,
        )

    def _counted_forward_backward(
        self, batch: Any, micro: MicroBatch, phases: Phases
    ) -> tuple[torch.Tensor, int | torch.Tensor | None]:
        """:meth:`_forward_backward` with its FLOPs counted (the first micro-batch that
        holds samples), then the plain one for every later micro-batch."""
        if not micro.count:  # a placeholder: nothing to count per sample
            return self._forward_backward(batch, micro, phases)
        result, flops = count_flops(lambda: self._forward_backward(batch, micro, phases))
        self.flops_per_sample = flops / micro.count
        self.step_micro = self._forward_backward
        return result

    def _forward_backward(
        self, batch: Any, micro: MicroBatch, phases: Phases
    ) -> tuple[torch.Tensor, int | torch.Tensor | None]:
        """One micro-batch's forward and backward; its loss, unweighted (a token-exact
        total: returned as its mean, its items noted)."""
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batch, phases)
        model, strategy, last_in_step = self.model, self.strategy, micro.last_in_step
        source = "loss_fn" if self.step_fn is None else "step_fn"
        # mid-window the micro-batch's forward and backward run out of gradient sync (one
        # no_sync for both); the set-up model keeps a placeholder out of sync BatchNorm
        with _NOTHING if last_in_step else model.unsynced():
            # the set-up model's forward module, in its context, the loss under the autocast
            with model.local_context(), strategy.autocast():
                loss, items = training_loss(self._loss(batch), source)
            phases.enter("backward")
            # weighted by the micro-batch's share
            loss = self.runtime.loop.propagate(
                loss, self.optimizer.strategy_optimizer, count=items, owners=(self.optimizer,)
            )
        return loss, items

    def _pipeline_forward_backward(
        self, batch: Any, phases: Phases
    ) -> tuple[torch.Tensor, int | torch.Tensor | None]:
        """One micro-batch through the pipeline's schedule: its forwards and backwards
        interleaved (timed as "forward"), the loss on the last stage (``loss_fn``'s, or
        ``step_fn``'s with the stage's output standing in for the model's: _pipeline_steps),
        shared with every rank."""
        loss_fn, step_fn = self.loss_fn, self.step_fn
        if step_fn is not None:  # the model it calls stands in for the pipeline
            module = self.model.module
            inputs = pipeline_inputs(step_fn, module, batch)
            target, loss_of = batch, pipeline_loss(step_fn, module)
        else:
            assert loss_fn is not None
            inputs, target = split_batch(batch)

            def loss_of(output: Any, target: Any) -> tuple[torch.Tensor, int | torch.Tensor | None]:
                return training_loss(loss_fn(output, target), "loss_fn")

        return self.runtime.loop.propagate_pipeline(
            self.pipeline, inputs, target, loss_of, owners=(self.optimizer,)
        )

    def epoch_record(self, state: FitState) -> dict[str, float]:
        """The epoch's training summary, reduced over ranks (the same dict on every rank)."""
        timer = self.timer
        assert timer is not None, "epoch_record follows run_epoch"
        phases = timer.summary()  # before the probe: its time is no part of the epoch's
        memory = _memory.peak_mib(self.strategy.device)  # the probe's buffer neither
        flops, peak = self._flops_and_peak()  # this rank's, summed over ranks below
        # a collective on every rank, here at the same point; a separate buffer (no training
        # state), so the epoch trained exactly as it would without it
        numel, dtype = _comm_probe.gradient_size(self.model)
        with _NOTHING if self.profile is None else self.profile.ranges.around("allreduce_probe"):
            comm_ms = _comm_probe.allreduce_ms(self.strategy, numel, dtype)
        # a tensor-parallel group's losses and samples count on its first rank
        leader = self.strategy.data_leader
        mine = torch.tensor(
            [
                state.settled_loss_sum() if leader else 0.0,
                float(state.samples) if leader else 0.0,
                float(state.skipped_steps),
                comm_ms,
                *memory,
                float(self.strategy.local_rank),
                flops,
                peak,
            ],
            dtype=torch.float64,
        )
        # one collective for the loss sums, the probe, every rank's memory and timing
        # one host read of what every rank sent; the rest is arithmetic on numbers
        per_rank = self.strategy.all_gather(torch.cat([mine, phases])).tolist()
        loss_sum, samples, skipped = (sum(row[i] for row in per_rank) for i in range(3))
        self.timing = EpochTiming.from_ranks(
            [row[9:] for row in per_rank],
            timer.samples,
            comm_ms=sum(row[3] for row in per_rank) / len(per_rank),  # the mean, as the phases
            comm_mb=numel * dtype.itemsize / 1e6,
            # local ranks count from 0 on each node: the processes sharing a node's cores
            local_processes=int(max(row[6] for row in per_rank)) + 1,
        )
        return {
            "epoch": state.epoch,
            "train_loss": loss_sum / samples if samples else float("nan"),
            # every rank skips the same steps
            "skipped_steps": int(skipped) // self.strategy.world_size,
            **_memory.memory_record([row[4:6] for row in per_rank], self.strategy.device),
            **self.timing.as_record(),
            **throughput_record(
                # the FLOPs of one sample over the ranks that compute it (each rank's count
                # of its part: the whole model, or under tensor parallelism a group's ranks
                # together), and every rank's peak
                flops_per_sample=sum(row[7] for row in per_rank) / self.strategy.data_world_size,
                samples_per_s=self.timing.samples_per_s,
                peak_sum=sum(row[8] for row in per_rank) if all(r[8] for r in per_rank) else 0,
                items=samples if self.token_exact else None,
                wall_s=self.timing.wall_s,
            ),
        }

    def _flops_and_peak(self) -> tuple[float, float]:
        """This rank's FLOPs per sample (0: not counted) and the peak of the devices it
        trains on (0: not known; a DataParallel rank's devices summed), for the epoch's
        gather: every rank then reports the same MFU. The peak is found once per fit."""
        if not self.flops_per_sample:
            return 0.0, 0.0
        peak = self._device_peak()
        if peak is None:
            return self.flops_per_sample, 0.0
        devices = max(len(getattr(self.strategy, "device_ids", ())), 1)
        return self.flops_per_sample, peak.flops * devices

    def _device_peak(self) -> Peak | None:
        """The training device's peak, looked up (or measured) the first time it is asked."""
        if not self._peak_found:
            strategy = self.strategy
            parameters = next(
                (p.dtype for p in self.model.parameters() if p.is_floating_point()), None
            )
            kind = matmul_kind(strategy.precision.name, parameters)
            self.peak = device_peak(strategy.device, kind)
            self._peak_found = True
        return self.peak

    def _loss(self, batch: Any) -> torch.Tensor:
        model = self.model.forward_module  # the backend's wrapper (compiled where asked)
        if self.step_fn is not None:
            return self.step_fn(model, batch)
        assert self.loss_fn is not None
        inputs, target = split_batch(batch)
        output = model(inputs)
        if self.placement.user_placed:
            target = follow_output(target, output)  # the loss runs on the output's device
        if self.output_check is not None:
            check, self.output_check = self.output_check, None
            check(output, target)
        return self.loss_fn(output, target)

    def _step(self, state: FitState) -> tuple[StepOutcome, torch.Tensor | None]:
        optimizer, settings = self.optimizer, self.settings
        outcome, norm = optimizer.step_now(
            clip=settings.clip,
            skip_nonfinite=settings.nonfinite == "skip",
            before_step=self.before_step,
        )
        state.global_step += 1
        if not outcome.stepped:
            state.skipped_steps += 1
        elif settings.step_scheduler and self.scheduler is not None:
            mark_stepped(self.scheduler, optimizer.optimizer)
            self.scheduler.step()
        return outcome, norm


def mark_stepped(scheduler: Any, stepped: torch.optim.Optimizer) -> None:
    """Tell torch's scheduler that its optimizer stepped, where a backend stepped a wrapper
    of it (Horovod's DistributedOptimizer is another object): torch watches the user's
    optimizer's ``step`` and would warn that the schedule skipped its first value."""
    user = getattr(scheduler, "optimizer", None)
    if user is not None and user is not stepped:
        user._opt_called = True
