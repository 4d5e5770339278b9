"""What a ``fit`` checks and finds on every rank before its first collective.

:func:`prepare_fit` validates the call's arguments (so a wrong one fails at the call, not in
torch later), describes the data and its global batch plan, finds the checkpoint to resume
from, and says which values every rank must agree on (see :data:`distkit.runtime.PORT`).
It changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distkit import checkpoint as ckpt
from distkit.data import GlobalBatchPlan, LoaderSpec
from distkit.data._batch_plan import batch_plan
from distkit.data._stream_spec import StreamSpec, check_stream
from distkit.errors import ConfigurationError
from distkit.runtime import (
    Proposal,
    Runtime,
    checked_placement,
    describe_compile,
    describe_data,
    describe_model,
    loader_spec,
    named_metrics,
    named_shapes,
    samples_of,
)
from distkit.strategies._placement import Placement
from distkit.strategies.base import Strategy
from distkit.trainer import _resume
from distkit.trainer._config import TrainerConfig
from distkit.trainer._fit_call import FitCall
from distkit.trainer._trainer_arguments import check_fit_args, check_scheduler, check_validation


@dataclass(frozen=True)
class FitPlan:
    """What a fit found before agreeing: its data, batch plan, checkpoint and placement."""

    spec: LoaderSpec | StreamSpec
    plan: GlobalBatchPlan | None  # None for a stream
    found: _resume.LoadedCheckpoint | None
    placement: Placement


def read_data(
    config: TrainerConfig, runtime: Runtime, data: Any, what: str, *, shuffle: bool
) -> LoaderSpec | StreamSpec:
    """``data`` as what every rank loads, at the config's batch size and workers."""
    return loader_spec(
        runtime,
        data,
        what,
        batch_size=config.batch_size,
        shuffle=shuffle,
        num_workers=config.num_workers,
    )


def plan_batches(
    config: TrainerConfig, runtime: Runtime, spec: LoaderSpec | StreamSpec
) -> GlobalBatchPlan | None:
    """The global batches of ``spec`` for this rank at the current world size."""
    return batch_plan(
        spec,
        world_size=runtime.data_world_size,
        rank=runtime.data_rank,
        grad_accum_steps=config.runtime_options.grad_accum_steps,
        seed=config.runtime_options.seed,
        drop_last=config.drop_last,
    )


def check_streams(
    config: TrainerConfig,
    spec: LoaderSpec | StreamSpec,
    val: LoaderSpec | StreamSpec | None,
    *,
    elastic: bool,
) -> None:
    """A stream among a fit's data can be read as often as the fit reads it."""
    epochs = config.max_epochs
    if isinstance(val, StreamSpec):
        every = config.val_every_n_steps
        reads, because = (
            (2, f"val_every_n_steps={every}") if every else (epochs, f"max_epochs={epochs}")
        )
        check_stream(val, reads=reads, because=because)
    if isinstance(spec, StreamSpec):
        check_stream(spec, reads=epochs, because=f"max_epochs={epochs}")
        if spec.self_sharded and elastic:
            raise ConfigurationError(
                "train_data is a ShardedStream and the strategy is elastic: when the group "
                "changes, each process's share of a stream that shards itself cannot be "
                "re-cut. Let distkit shard the stream (pass it without ShardedStream)"
            )


def check_saves(
    config: TrainerConfig, strategy: Strategy, checkpoints: ckpt.CheckpointFolder | None
) -> None:
    """The fit's checkpoints can be written: now, not after the first epoch trained."""
    if checkpoints is not None and strategy.is_main:
        checkpoints.check_writable()
    if config.checkpoint_async and strategy.elastic is not None:
        raise ConfigurationError(
            f"checkpoint_async=True with {strategy.name}, an elastic backend: a save still "
            "persisting when the group re-forms would be waited for by the old ranks only. "
            "Save blocking (checkpoint_async=False) under an elastic backend"
        )


def prepare_fit(
    config: TrainerConfig,
    runtime: Runtime,
    call: FitCall,
    *,
    checkpoints: ckpt.CheckpointFolder | None,
    pending: _resume.LoadedCheckpoint | None,
    callbacks: Any,
    owner: object,
) -> Proposal[FitPlan]:
    """The fit's checks and findings on this rank.

    Args:
        checkpoints: the ``checkpoint_dir`` folder (None: none).
        pending: a checkpoint ``load_checkpoint`` loaded for this fit (it wins over
            ``resume``).
        callbacks: the fit's callbacks (a ``CallbackList``): checked, and described for the
            agreement.
        owner: what the callbacks are given (the Trainer): their own checks read it.
    """
    model, optimizer = call.model, call.optimizer
    # the user's parameters, as the strategy counts them (DeepSpeed re-points a set-up
    # optimizer at its partitions: a second fit with it is still the user's)
    io = runtime.strategy.state_io
    groups = io.param_groups(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    check_fit_args(model, optimizer, call.loss_fn, call.step_fn, groups)
    placement = checked_placement(runtime.setups, model, config.input_device_override)
    check_scheduler(call.scheduler, optimizer, per_step=config.scheduler_interval == "step")
    check_validation(
        call.val_data, call.loss_fn, call.metrics, config.val_every_n_steps, call.validation_step
    )
    named_metrics(call.metrics)
    strategy = runtime.strategy
    spec = read_data(config, runtime, call.train_data, "train_data", shuffle=config.shuffle)
    plan = plan_batches(config, runtime, spec)
    val = (
        None
        if call.val_data is None
        else read_data(config, runtime, call.val_data, "val_data", shuffle=False)
    )
    check_streams(config, spec, val, elastic=strategy.elastic is not None)
    check_saves(config, strategy, checkpoints)
    found = pending or _resume.find_resume(
        config.resume,
        checkpoints,
        strategy.device,
        announce=strategy.is_main,
        storage_options=config.runtime_options.storage_options,
    )
    if found is not None:
        epoch_samples = None if plan is None else plan.samples_per_epoch
        _resume.check_fits(
            found, model, optimizer, samples_of(spec), epoch_samples, io=strategy.state_io
        )
    callbacks.validate(owner)
    # what the backend cannot do with these settings, refused before anything is set up
    strategy.check_step_settings(
        before_step=bool(callbacks.overriding("on_before_optimizer_step")),
        clip=config.clip,
        skip_nonfinite=config.nonfinite == "skip",
    )
    agreed = {
        "resume from": "no checkpoint" if found is None else found.label,
        "train_data samples": describe_data(spec),
        "batch plan": describe_plan(config, spec, plan),
        "val_data samples": "none" if val is None else describe_data(val),
        "model": describe_model(model),
        "optimizer": f"{type(optimizer).__name__}, {len(optimizer.param_groups)} group(s)",
        "scheduler": "none" if call.scheduler is None else type(call.scheduler).__name__,
        "settings": f"strategy={strategy.name} {strategy.options}, {agreed_settings(config)}",
        "strategy options": strategy.agreed_options() or "none",
        # called on every rank: the same kinds in the same order (some are collectives)
        "callbacks": callbacks.describe(),
    }
    details = {"model": lambda: named_shapes(model)}
    # each rank's devices of a model the user placed: ranks sharing one GPU are refused
    fit_plan = FitPlan(spec, plan, found, placement)
    return Proposal(agreed, fit_plan, shared=placement.claim(), details=details)


def agreed_settings(config: TrainerConfig) -> str:
    """The loop's settings that every rank must hold alike (the strategy's own options are
    agreed beside them)."""
    return (
        f"max_epochs={config.max_epochs}, max_steps={config.max_steps}, "
        f"seed={config.runtime_options.seed}, "
        f"scheduler_interval={config.scheduler_interval}, nonfinite={config.nonfinite}, "
        f"checkpoint_every={config.checkpoint_every}, clip={config.clip}, "
        f"log_every_n_steps={config.log_every_n_steps}, "
        f"val_every_n_steps={config.val_every_n_steps}, "
        f"compile={describe_compile(config.compile_options)}"
    )


def describe_plan(config: TrainerConfig, spec: LoaderSpec | StreamSpec, plan: Any) -> str:
    per_step = f"{config.runtime_options.grad_accum_steps} accumulated"
    if isinstance(spec, StreamSpec):
        size = "whole batches" if spec.batch_size is None else f"{spec.batch_size} per rank"
        return f"{size} x {per_step}, a stream, drop_last={spec.drop_last or config.drop_last}"
    return str(plan.describe())
