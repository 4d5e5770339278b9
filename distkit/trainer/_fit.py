"""A fit's training, once its call is prepared and agreed: set up, resumed or seeded, run.

:func:`train` sets the model and optimizer up through the runtime, restores the checkpoint's
run (or seeds this rank's generators), and runs the epochs: once, or, on an elastic backend,
again from the last commit whenever the group changed (a new rank and world size, so a new
batch plan). It takes the fit's settings, the runtime and what the Trainer holds for the fit;
never the Trainer (``owner`` is only handed to the callbacks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from distkit import checkpoint as ckpt
from distkit.callbacks._list import CallbackList
from distkit.data import GlobalBatchPlan
from distkit.data._feed import train_feed
from distkit.faults._preempt import Preemption
from distkit.runtime import (
    ProfileRun,
    Runtime,
    RuntimeLoader,
    SetUpModel,
    SetUpOptimizer,
    named_metrics,
    open_profile,
    renew_topology,
    samples_of,
    seed_generators,
)
from distkit.strategies.base import Strategy
from distkit.trainer import _checkpoint_save, _resume
from distkit.trainer._config import TrainerConfig
from distkit.trainer._epoch_loop import EpochLoop, StopRequest, hyperparams
from distkit.trainer._fit_call import FitCall
from distkit.trainer._fit_state import FitState
from distkit.trainer._logging import LogSink, LogWindow
from distkit.trainer._losses import LossLedger
from distkit.trainer._nonfinite import NonFiniteWatch
from distkit.trainer._prepare import FitPlan, plan_batches
from distkit.trainer._resume import LatestFit
from distkit.trainer._snapshot import RunSnapshot
from distkit.trainer._step_loop import StepLoop, StepLoopSettings


def train(
    config: TrainerConfig,
    runtime: Runtime,
    prepared: FitPlan,
    payload: dict[str, Any] | None,
    call: FitCall,
    *,
    callbacks: CallbackList,
    checkpoints: ckpt.CheckpointFolder | None,
    sink: LogSink,
    stop: StopRequest,
    owner: object,
    keep: Callable[[LatestFit], None],
    preempt: Preemption | None = None,
) -> EpochLoop:
    """Train ``call``'s model as ``prepared`` says; returns the last (elastic: latest)
    epoch loop, which holds the fit's state and how it ended.

    Args:
        payload: the checkpoint to resume from (its weights already loaded), or None.
        keep: receives the fit's :class:`LatestFit` before the first step (the Trainer
            keeps it for ``save_checkpoint``, ``global_step`` and the like).
        preempt: the fit's preemption (the loop stops where it says and saves), or None.
    """
    strategy = runtime.strategy
    model, optimizer, scheduler = call.model, call.optimizer, call.scheduler
    # the fit is a loop over the runtime: its set-up model and optimizer, its backward
    fitted = runtime.loop.set_up_fit(model, optimizer, prepared.placement, call.compiler)
    state = _first_state(config, strategy, payload, scheduler, callbacks)
    keep(latest := LatestFit(model, optimizer, scheduler, state, samples_of(prepared.spec)))
    sink.hyperparams(hyperparams(config, runtime, model, optimizer, samples_of(prepared.spec)))
    saves = _checkpoint_save.FolderSaves.of(strategy, latest, callbacks, checkpoints, config, sink)
    before_step = _before_step(callbacks, owner, optimizer)
    profile = open_profile(config.profiling, strategy.rank, strategy.device, strategy.world_size)
    runs: list[EpochLoop] = []

    def body() -> None:
        # an elastic strategy runs this again in a re-formed group: new rank, new size
        renew_topology(runtime)
        plan = plan_batches(config, runtime, prepared.spec) if runs else prepared.plan
        run = EpochLoop(
            config=config,
            runtime=runtime,
            owner=owner,
            stop=stop,
            loop=_step_loop(config, runtime, prepared, plan, call, fitted, before_step, profile),
            state=state,
            callbacks=callbacks,
            sink=sink,
            window=LogWindow(strategy, config.log_every_n_steps),
            validate=_validation(config, runtime, call),
            save=None if saves is None else saves.save,
            preempt=preempt,
        )
        runs.append(run)
        run.run()

    snapshot = lambda: RunSnapshot(model, optimizer, scheduler, state, callbacks)  # noqa: E731
    _run(body, runtime, profile, snapshot, saves)
    return runs[-1]


def _run(
    body: Callable[[], None],
    runtime: Runtime,
    profile: ProfileRun | None,
    snapshot: Callable[[], RunSnapshot],
    saves: _checkpoint_save.FolderSaves | None,
) -> None:
    """Run the fit's epochs (``body``) under its profiler (None when off, or on a rank the
    settings leave out: the loop then checks only that); an elastic strategy runs them
    again, from the last commit of ``snapshot()``, whenever the group changed. The fit's
    checkpoint in flight (``saves``) is complete when it returns; a failing fit lets it
    complete (or leave the one before) without a collective."""
    elastic = runtime.strategy.elastic
    try:
        with contextlib.nullcontext() if profile is None else profile:
            if elastic is None:
                body()
            else:
                elastic.run(body, snapshot())
        if saves is not None:
            saves.finish()
    except BaseException:
        if saves is not None:
            saves.finish_here()
        raise
    finally:
        runtime.loop.end_fit()


def _first_state(
    config: TrainerConfig,
    strategy: Strategy,
    payload: dict[str, Any] | None,
    scheduler: Any,
    callbacks: CallbackList,
) -> FitState:
    """Where the fit starts: the checkpoint's state restored, or a fresh one, seeded."""
    if payload is None:
        seed_generators(config.runtime_options.seed + strategy.data_rank)
        return FitState()
    state = _resume.restore_run(payload, strategy, scheduler, config.runtime_options.seed)
    callbacks.load_state_dict(payload.get("callbacks") or {})
    return state


def _before_step(
    callbacks: CallbackList, owner: object, optimizer: torch.optim.Optimizer
) -> Callable[[], None] | None:
    """The callbacks' ``on_before_optimizer_step`` with the user's optimizer (not a
    backend's wrapper of it), run on the final gradients; None where none overrides it."""
    if not callbacks.overriding("on_before_optimizer_step"):
        return None
    return functools.partial(callbacks.call, "on_before_optimizer_step", owner, optimizer)


def _step_loop(
    config: TrainerConfig,
    runtime: Runtime,
    prepared: FitPlan,
    plan: GlobalBatchPlan | None,
    call: FitCall,
    fitted: tuple[SetUpModel, SetUpOptimizer],
    before_step: Callable[[], None] | None,
    profile: ProfileRun | None,
) -> StepLoop:
    """The step loop of one run of the fit's epochs, over a feed of ``plan``'s batches."""
    strategy = runtime.strategy
    feed = train_feed(
        strategy,
        prepared.spec,
        plan,
        seed=config.runtime_options.seed,
        grad_accum_steps=config.runtime_options.grad_accum_steps,
        drop_last=config.drop_last,
    )
    loader = RuntimeLoader(
        feed,
        seed=config.runtime_options.seed,
        rank=strategy.rank,
        device=prepared.placement.input_device,
        enter=runtime.loop.hold,
    )
    settings = StepLoopSettings(
        max_epochs=config.max_epochs,
        seed=config.runtime_options.seed,
        nonfinite=config.nonfinite,
        step_scheduler=config.scheduler_interval == "step",
        progress=config.progress,
        clip=config.clip,
    )
    return StepLoop(
        runtime=runtime,
        model=fitted[0],
        optimizer=fitted[1],
        loader=loader,
        loss_fn=call.loss_fn,
        step_fn=call.step_fn,
        scheduler=call.scheduler,
        settings=settings,
        rank_progress=runtime.progress,
        placement=prepared.placement,
        losses=LossLedger(strategy.device, watch=config.nonfinite == "raise"),
        watch=NonFiniteWatch(config.nonfinite == "raise", config.log_every_n_steps),
        before_step=before_step,
        profile=profile,
        output_check=_metric_check(call),
        # torch's FLOP counter cannot see inside a compiled forward (nor compiled blocks):
        # no count, no MFU
        count_flops=call.compiler is None,
    )


def _validation(
    config: TrainerConfig, runtime: Runtime, call: FitCall
) -> Callable[[], dict[str, float]] | None:
    """The fit's validation, as ``runtime.evaluate`` runs it; None without validation data."""
    if call.val_data is None:
        return None

    def validate() -> dict[str, float]:
        return runtime.evaluate(
            call.model,
            call.val_data,
            None if call.validation_step is not None else call.loss_fn,
            call.metrics,
            step_fn=call.validation_step,
            batch_size=config.batch_size,
            num_workers=config.num_workers,
            seed=config.runtime_options.seed,
            input_device=config.input_device_override,
        )

    return validate


def _metric_check(call: FitCall) -> Callable[[Any, Any], None] | None:
    """Validation hands its metrics the model's output and the targets: where training's
    first batch gives a dict (transformers' models, in training and in evaluation alike), a
    metric that cannot read it fails there, before any step, not after the first epoch.
    Other outputs are left to validation: some models return more in training than in
    evaluation (Inception's auxiliary logits), which a metric never sees."""
    named = named_metrics(call.metrics)
    if not named or call.val_data is None or call.validation_step is not None:
        return None

    def metric_check(output: Any, target: Any) -> None:
        if not isinstance(output, Mapping):
            return
        with torch.no_grad():
            for metric in named.values():
                metric.batch_state(_detached(output), _detached(target))

    return metric_check


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value
