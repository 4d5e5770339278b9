"""The order of one ``fit``: epochs, steps, validation, logging, callbacks, checkpoints.

The trainer builds an :class:`EpochLoop` and calls :meth:`EpochLoop.run`; the micro-batches
and steps of an epoch are :class:`~distkit.trainer._step_loop.StepLoop`'s. Everything here
happens on every rank in the same order, so every collective (validation, checkpoints, the
stop decision, log points) meets its peers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from distkit.callbacks._list import CallbackList
from distkit.faults._preempt import Preemption, Stop
from distkit.runtime import Runtime, agreed_stop, tagged_sum
from distkit.trainer._config import TrainerConfig
from distkit.trainer._fit_state import FitState
from distkit.trainer._logging import LogSink, LogWindow, StepLogs
from distkit.trainer._losses import step_mean
from distkit.trainer._memory import MEMORY_KEYS, memory_text
from distkit.trainer._step_loop import StepLoop, StepResult, mark_stepped
from distkit.trainer._throughput import THROUGHPUT_KEYS, throughput_text

#: the epoch record's per-phase timings stay out of the loggers (they are in the report)
_TIMING_PREFIX = "time_"


@dataclass
class StopRequest:
    """``trainer.should_stop``: set by a callback on any rank; at each stop point the ranks
    agree (any rank's request stops every rank) and every rank's flag then says so."""

    requested: bool = False


@dataclass(kw_only=True)
class EpochLoop:
    """One ``fit`` after its set-up: runs the epochs and says how training ended.

    It reads the fit's settings from ``config`` (as they were when the fit started) and
    talks to the backend through ``runtime``; ``owner`` (the Trainer) is only handed to the
    callbacks, whose hooks take it.
    """

    config: TrainerConfig
    runtime: Runtime
    owner: object
    stop: StopRequest
    loop: StepLoop
    state: FitState
    callbacks: CallbackList
    sink: LogSink
    window: LogWindow
    #: evaluates the validation data: ``{"loss": ..., <metric>: ...}`` (None: no val_data)
    validate: Callable[[], dict[str, float]] | None
    #: writes the run into ``checkpoint_dir`` (None: no ``checkpoint_dir``)
    save: Callable[[], None] | None
    #: the fit's preempting signals and the ranks' agreement on where to stop (None: off)
    preempt: Preemption | None = None
    #: where a preemption stopped the run, once it did (None: it was not preempted)
    preempted: Stop | None = None
    stopped_early: bool = False
    _validated_at: int | None = None  # the global step of the latest validation
    _last_validation: dict[str, float] = field(default_factory=dict)
    _stop_each_step: bool = False  # callbacks.stop_each_step, read once (run)
    #: whether a callback overrides on_train_step_end, read once (run): else no step's
    #: logs are made, and only log points read the learning rate
    _steps_read: bool = True
    _saved_at: int | None = None  # the global step of the newest checkpoint in the folder

    @property
    def validations(self) -> list[dict[str, float]]:
        """Every validation of the run so far (a resumed run's earlier ones included)."""
        return self.state.validations

    def run(self) -> None:
        """Train up to ``max_epochs`` / ``max_steps``, or until ``should_stop``; then, with a
        ``checkpoint_dir``, make sure the trained state is on disk."""
        # the state a fit starts from is on disk already (resumed) or holds nothing trained
        self._saved_at = self.state.global_step
        self._train()
        if self.save is not None and self._saved_at != self.state.global_step:
            self._save()

    def _train(self) -> None:
        state = self.state
        self._stop_each_step = self.callbacks.stop_each_step
        self.callbacks.call("on_fit_start", self.owner)
        self._steps_read = bool(self.callbacks.overriding("on_train_step_end"))
        while state.epoch < self.config.max_epochs and not self._steps_done():
            end = self.loop.run_epoch(state, self._after_step)
            # a stop on the epoch's last step (max_steps, should_stop) still closes the epoch:
            # its validation, record and hooks, as the same run without the stop would; a
            # preemption there saved the run before them, and its resume runs them
            if end == "stopped" or (end == "stopped-at-end" and self.preempted is not None):
                self._check_losses()  # the steps since the last check point
                return  # max_steps or should_stop inside the epoch
            if self._end_epoch():
                return

    # ------------------------------------------------------------------ per step
    def _after_step(self, state: FitState, result: StepResult) -> bool:
        config = self.config
        step = state.global_step
        self.window.add(result.items)
        if self._steps_read:
            self.callbacks.call("on_train_step_end", self.owner, self._step_logs(state, result))
        stop = self._agree_stop() if self._stop_each_step else False
        if self.window.due(step):  # a check point: its non-finite check rides in the gather
            loop = self.loop
            loss, items, any_stop = self.window.gather(
                loop.losses, loop.watch, step, stop=self.stop.requested
            )
            loop.optimizer.check_items()  # token-exact losses: a step over no items
            row: dict[str, Any] = {
                "train_loss": loss,
                "lr": _lr(loop.optimizer.optimizer),
                "epoch": state.epoch,
            }
            if result.grad_norm is not None:
                row["grad_norm"] = result.grad_norm
            self.sink.log(row, step)
            loop.log_point(state, loss, items)  # the bar: loss, samples/s, tokens/s, MFU
            stop = stop or any_stop
            self.stop.requested = self.stop.requested or any_stop
        val_every = config.val_every_n_steps
        if self.validate is not None and val_every is not None and step % val_every == 0:
            self._validation()
            stop = self._agree_stop() or stop
        every = config.checkpoint_every
        if every != "epoch" and step % int(every) == 0:
            self._save_point()
        self.sink.flush()
        if self.preempt is not None and self.preempt.due(step):
            self._stop_for_preemption(step)
            return True
        if stop:
            self.stopped_early = True
        return stop or self._steps_done()

    def _stop_for_preemption(self, step: int) -> None:
        """Every rank is at the agreed step: check that they are, and save the run there."""
        assert self.preempt is not None
        strategy = self.runtime.strategy
        stop = agreed_stop(
            self.preempt,
            strategy,
            step,
            why=f"{strategy.name} trains without a collective in every step, which the "
            "agreement relies on",
        )
        if self._saved_at != step:
            self._save()
        stop.saved_at = time.time()
        self.preempted = stop

    def _step_logs(self, state: FitState, result: StepResult) -> StepLogs:
        values: dict[str, Any] = {
            "step": state.global_step,
            "epoch": state.epoch,
            # computed when read (most steps nobody reads it: no tensor op for them)
            "loss": functools.partial(step_mean, result.losses, result.counts, result.items)
            if result.samples
            else float("nan"),
            "lr": _lr(self.loop.optimizer.optimizer),
            "skipped": not result.outcome.stepped,
        }
        if result.grad_norm is not None:
            values["grad_norm"] = result.grad_norm
        return StepLogs(values)

    # ------------------------------------------------------------------ per epoch
    def _end_epoch(self) -> bool:
        """Close the epoch (record, validation, scheduler, reports); True: stop here."""
        config, state, loop = self.config, self.state, self.loop
        self._check_losses()
        record = loop.epoch_record(state)
        if self.validate is not None:
            if self._validated_at == state.global_step:  # the epoch's last step validated
                record.update(self._last_validation)
            else:
                record.update(self._validation())
        if loop.scheduler is not None and config.scheduler_interval == "epoch":
            mark_stepped(loop.scheduler, loop.optimizer.optimizer)
            step_scheduler(loop.scheduler, record)
        state.history.append(record)
        state.epoch, state.position, state.loss_sum, state.samples = state.epoch + 1, 0, 0.0, 0
        state.skipped_steps, state.local_position = 0, 0
        self._report(record)
        self.sink.log(
            {k: v for k, v in record.items() if not k.startswith(_TIMING_PREFIX)},
            state.global_step,
        )
        self.callbacks.call("on_epoch_end", self.owner, record)
        self.sink.flush()
        if config.checkpoint_every == "epoch":
            self._save_point()
        if self._agree_stop():
            self.stopped_early = True
            return True
        return False

    # ------------------------------------------------------------------ helpers
    def _validation(self) -> dict[str, float]:
        assert self.validate is not None
        state = self.state
        self._check_losses()
        self.runtime.progress.phase = "validation"
        self.callbacks.call("on_validation_start", self.owner)
        metrics = {f"val_{key}": value for key, value in self.validate().items()}
        self._validated_at, self._last_validation = state.global_step, metrics
        state.validations.append({"step": state.global_step, "epoch": state.epoch, **metrics})
        self.sink.log(metrics, state.global_step)
        self.callbacks.call("on_validation_end", self.owner, metrics)
        return metrics

    def _save_point(self) -> None:
        """A ``checkpoint_every`` point: the checkpoint (with a ``checkpoint_dir``), then the
        strategy's commit (elastic: may re-form the group, raising to run the body again)."""
        self._save()
        elastic = self.runtime.strategy.elastic
        if elastic is not None:
            elastic.commit()

    def _save(self) -> None:
        """The losses checked, then the checkpoint (with a ``checkpoint_dir``)."""
        self._check_losses()  # never a checkpoint of parameters trained on a NaN
        if self.save is not None:
            self.runtime.progress.phase = "checkpoint"
            self.save()
            self._saved_at = self.state.global_step

    def _report(self, record: dict[str, float]) -> None:
        """The epoch's line (and timing table) on rank 0, when ``progress`` is on."""
        loop = self.loop
        if not (self.config.progress and self.runtime.is_main):
            return
        # each with a part of its own
        hidden = ("epoch", "skipped_steps", "samples_per_s", *MEMORY_KEYS, *THROUGHPUT_KEYS)
        parts = [f"epoch {int(record['epoch']) + 1}/{self.config.max_epochs}"]
        parts += [
            f"{k}={v:.4f}"
            for k, v in record.items()
            if k not in hidden and not k.startswith(_TIMING_PREFIX)
        ]
        if record.get("skipped_steps"):
            parts.append(f"skipped_steps={int(record['skipped_steps'])} (non-finite gradients)")
        memory = memory_text(record)
        if memory:
            parts.append(memory)
        tqdm.write(" ".join(parts))
        if loop.timing is not None:
            tqdm.write(loop.timing.table(self.runtime.strategy.comm_phase, loop.loader.num_workers))
        throughput = throughput_text(record, loop.peak)
        if throughput:
            tqdm.write(throughput)

    def _check_losses(self) -> None:
        """A check point: the noted losses folded into the totals, and (``nonfinite="raise"``)
        an error on every rank if a step since the last check had a non-finite loss on any
        rank (a collective then)."""
        loop = self.loop
        loop.losses.fold()
        loop.watch.check(self.runtime.strategy, loop.losses, self.state.global_step)
        loop.optimizer.check_items()  # token-exact losses: a step over no items (device counts)

    def _agree_stop(self) -> bool:
        """Whether any rank set ``should_stop``; afterwards every rank's flag says so."""
        # a host-side sum (a gloo group beside nccl, Horovod's allreduce_async): a callback
        # that may stop after every step costs the device no synchronisation; tagged, so a
        # rank that went into a collective of its own from a callback fails every rank
        (flags,) = tagged_sum(self.runtime.strategy, "stop", [float(self.stop.requested)])
        stop = flags > 0
        self.stop.requested = stop
        return stop

    def _steps_done(self) -> bool:
        limit = self.config.max_steps
        return limit is not None and self.state.global_step >= limit


def hyperparams(
    config: TrainerConfig,
    runtime: Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: int | None,
) -> dict[str, Any]:
    """What the loggers record of a fit's settings, once, before its first step."""
    clip = config.clip
    return {
        "strategy": runtime.strategy.name,
        "world_size": runtime.world_size,
        "batch_size": config.batch_size,
        "grad_accum_steps": config.runtime_options.grad_accum_steps,
        "precision": runtime.strategy.options.precision,
        "max_epochs": config.max_epochs,
        "max_steps": config.max_steps,
        "seed": config.runtime_options.seed,
        "train_samples": samples,
        "model": type(model).__name__,
        "optimizer": type(optimizer).__name__,
        "lr": optimizer.param_groups[0].get("lr"),
        "gradient_clip_norm": None if clip is None else clip.max_norm,
        "gradient_clip_value": None if clip is None else clip.max_value,
    }


def _lr(optimizer: torch.optim.Optimizer) -> float:
    lr = optimizer.param_groups[0].get("lr", float("nan"))
    return float(lr)


def step_scheduler(scheduler: Any, record: dict[str, float]) -> None:
    """The epoch's scheduler step (ReduceLROnPlateau gets the validation loss, else the
    training loss)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(record.get("val_loss", record["train_loss"]))
    else:
        scheduler.step()
