"""One epoch of training: micro-batches, accumulation, optimizer steps. Strategy hooks only."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from distkit.batch import split_batch
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


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, as this rank saw it (device values stay on the device)."""

    losses: list[torch.Tensor]  # the batch-mean losses of its counted micro-batches
    #: what each mean is over: their real samples (this rank's), or a token-exact loss's items
    counts: list[int | torch.Tensor]
    samples: int  # this rank's real samples in the step
    #: the step's sum of ``counts`` (its samples, or its items: a device tensor where the
    #: counts were)
    items: int | torch.Tensor
    outcome: StepOutcome
    grad_norm: torch.Tensor | None  # total norm of the averaged gradients before clipping


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

    @property
    def strategy(self) -> Strategy:
        return self.runtime.strategy

    def __post_init__(self) -> None:
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
        strategy, loop = self.strategy, self.runtime.loop
        model, optimizer = self.model, self.optimizer
        inner = optimizer.strategy_optimizer
        model.train()
        # the losses stay on the device, summed at check points: no tensor op per step
        losses = self.losses
        state.loss_sum = losses.begin_epoch(float(state.loss_sum))
        state.ledger = losses
        step_losses: list[torch.Tensor] = []
        step_counts: list[int | torch.Tensor] = []
        step_samples = 0
        step_items: int | torch.Tensor = 0
        source = "loss_fn" if self.step_fn is None else "step_fn"
        owners = (optimizer,)
        loader = self.loader.resume_at(state.epoch, state.position, state.local_position)
        left = loader.remaining()  # None: a stream, whose length is not known
        bar = tqdm(
            total=left,
            desc=f"epoch {state.epoch + 1}/{self.settings.max_epochs}",
            # a bar only where a person watches: piped output (CI, horovodrun) gets epoch lines
            disable=not (self.settings.progress and strategy.is_main and sys.stderr.isatty()),
            leave=False,
            dynamic_ncols=True,
        )
        progress = self.rank_progress
        progress.epoch, progress.step, progress.phase = state.epoch, state.global_step, "data"
        stopped, fresh_step = False, True  # fresh: the next micro-batch starts a step
        skip_nonfinite = self.settings.nonfinite == "skip"
        timer = self.timer = StepTimer(strategy.device)
        _memory.reset_peak(strategy.device)  # the epoch's peak, read by epoch_record
        start_position = state.position
        timer.start()
        profile = self.profile
        ranges = None if profile is None else profile.ranges
        if ranges is not None:
            ranges.begin("data")
        taken = 0  # this rank's micro-batches of the epoch, so far
        with bar, contextlib.closing(iter(loader)) as batches:
            for batch in batches:
                taken += 1
                micro = loop.micro  # the batch's micro-batch: its weight, its window's end
                assert micro is not None
                timer.mark("data")
                if ranges is not None:
                    ranges.begin("forward")
                if fresh_step:
                    # freed here, before forward, as a hand-written loop does: freed right
                    # after the step instead, with the step's activations, the allocator
                    # hands the memory back to the OS and page-faults it in again each step
                    # (measured: ~8% slower steps of the benchmarks' CNN on CPU)
                    optimizer.clear()
                    fresh_step = False
                progress.phase = "forward"
                # mid-window the micro-batch's forward and backward run out of gradient sync
                # (one no_sync for both); the set-up model keeps a placeholder out of sync
                # BatchNorm; the loss runs under the autocast too, as the model does
                with _NOTHING if micro.last_in_step else model.unsynced():
                    # the set-up model's forward module, in its context (a placeholder out of
                    # sync BatchNorm), the loss under the autocast as well
                    with model.local_context(), strategy.autocast():
                        loss, items = training_loss(self._loss(batch), source)
                    timer.mark("forward")
                    if ranges is not None:
                        ranges.begin("backward")
                    progress.phase = "backward"
                    # weighted by the micro-batch's share; returned unweighted, one value (a
                    # token-exact total: scaled, its items noted; returned as its mean)
                    loss = loop.propagate(loss, inner, count=items, owners=owners)
                timer.mark("backward")
                if ranges is not None:
                    ranges.end()
                counted = micro.count
                # "skip" reads the loss here (its step reads the gradients anyway); "raise"
                # reads the noted losses at the next check point: no host sync
                if skip_nonfinite and counted and not torch.isfinite(loss):
                    counted = 0  # its step is skipped: keep it out of the epoch's mean loss
                if counted:
                    step_losses.append(loss.detach())
                    weight = counted if items is None else items
                    step_counts.append(weight)
                    step_samples += counted
                    step_items = step_items + weight
                state.position += micro.samples
                if state.local_position is not None:
                    state.local_position += micro.count
                bar.update()
                if micro.last_in_step:
                    progress.phase = "optimizer"
                    if ranges is not None:
                        ranges.begin("optimizer")
                    losses.add_step(step_losses, step_counts, state.epoch, state.global_step)
                    outcome, norm = self._step(state)
                    state.samples = state.samples + step_items
                    timer.mark("optimizer")
                    if ranges is not None:
                        ranges.end()
                    timer.steps += 1
                    progress.step = state.global_step
                    result = StepResult(
                        step_losses, step_counts, step_samples, step_items, outcome, norm
                    )
                    stopped = after_step(state, result)
                    if profile is not None:
                        profile.step()  # the step's callbacks and logs count in its window
                    step_losses, step_counts, step_samples, step_items = [], [], 0, 0
                    fresh_step = True
                    timer.mark("other")  # checkpoints: not part of a step
                    if stopped:
                        break
                progress.phase = "data"
                if ranges is not None:
                    ranges.begin("data")
        if ranges is not None:
            ranges.end()
        timer.samples = state.position - start_position
        optimizer.clear()  # no gradients held through validation and checkpoints
        if not stopped:
            return "ended"
        # every rank stops at the same step; with a known length each knows whether it was
        # the epoch's last (a stream's end is found only by reading on: "stopped")
        return "stopped-at-end" if left is not None and taken >= left else "stopped"

    def epoch_record(self, state: FitState) -> dict[str, float]:
        """The epoch's training summary, reduced over ranks (the same dict on every rank)."""
        timer = self.timer
        assert timer is not None, "epoch_record follows run_epoch"
        phases = timer.summary()  # before the probe: its time is no part of the epoch's
        memory = _memory.peak_mib(self.strategy.device)  # the probe's buffer neither
        # a collective on every rank, here at the same point; a separate buffer (no training
        # state), so the epoch trained exactly as it would without it
        numel, dtype = _comm_probe.gradient_size(self.model)
        with _NOTHING if self.profile is None else self.profile.ranges.around("allreduce_probe"):
            comm_ms = _comm_probe.allreduce_ms(self.strategy, numel, dtype)
        mine = torch.tensor(
            [
                state.settled_loss_sum(),
                float(state.samples),
                float(state.skipped_steps),
                comm_ms,
                *memory,
                float(self.strategy.local_rank),
            ],
            dtype=torch.float64,
        )
        # one collective for the loss sums, the probe, every rank's memory and timing
        per_rank = self.strategy.all_gather(torch.cat([mine, phases]))
        totals = per_rank[:, :3].sum(dim=0)
        self.timing = EpochTiming.from_ranks(
            per_rank[:, 7:],
            timer.samples,
            comm_ms=float(per_rank[:, 3].mean()),  # like the phases: the mean over ranks
            comm_mb=numel * dtype.itemsize / 1e6,
            # local ranks count from 0 on each node: the processes sharing a node's cores
            local_processes=int(per_rank[:, 6].max()) + 1,
        )
        return {
            "epoch": state.epoch,
            "train_loss": (totals[0] / totals[1]).item(),
            # every rank skips the same steps
            "skipped_steps": int(totals[2].item()) // self.strategy.world_size,
            **_memory.memory_record(per_rank[:, 4:6], self.strategy.device),
            **self.timing.as_record(),
        }

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
