"""What each collective call of the trainer checks before it starts, and what must match.

Each ``prepare_*`` runs on every rank before the call's first collective and changes nothing:
it validates the arguments (so a wrong one fails at the call, not in torch later), finds what
the call needs, and says which values every rank must agree on (see
:mod:`distkit.runtime._agreement`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from distkit import checkpoint as ckpt
from distkit._validate import check_path
from distkit.data import GlobalBatchPlan, LoaderSpec
from distkit.data._samplers import BatchSamplerPlan, SamplerPlan
from distkit.data._stream_spec import StreamSpec, check_stream
from distkit.errors import ConfigurationError
from distkit.metrics import Metric
from distkit.runtime import _agreement, _resume
from distkit.runtime._checks import check_fit_args, check_model, check_scheduler, check_validation
from distkit.runtime._compile import describe as describe_compile
from distkit.runtime._evaluation import LossFn, Metrics, named_metrics
from distkit.runtime._fit_call import FitCall
from distkit.strategies._placement import Placement

if TYPE_CHECKING:
    from distkit.runtime._fit_state import Stateful
    from distkit.runtime._resume import Run
    from distkit.strategies.base import Strategy
    from distkit.trainer import Trainer


@dataclass(frozen=True)
class FitPlan:
    """What a fit found before agreeing: its data, batch plan, checkpoint and placement."""

    spec: LoaderSpec | StreamSpec
    plan: GlobalBatchPlan | None  # None for a stream
    found: _resume.Found | None
    placement: Placement


def prepare_fit(trainer: Trainer, call: FitCall) -> _agreement.Prepared[FitPlan]:
    model, optimizer = call.model, call.optimizer
    check_fit_args(model, optimizer, call.loss_fn, call.step_fn)
    placement = checked_placement(trainer, model)
    check_scheduler(call.scheduler, optimizer, per_step=trainer.scheduler_interval == "step")
    check_validation(call.val_data, call.loss_fn, call.metrics, trainer.val_every_n_steps)
    named_metrics(call.metrics)
    strategy = trainer.strategy
    spec = trainer._loader_spec(call.train_data, "train_data", shuffle=trainer.shuffle)
    plan = batch_plan(trainer, spec)
    val = (
        None
        if call.val_data is None
        else trainer._loader_spec(call.val_data, "val_data", shuffle=False)
    )
    if isinstance(val, StreamSpec):
        every = trainer.val_every_n_steps
        reads, because = (
            (2, f"val_every_n_steps={every}")
            if every
            else (trainer.max_epochs, f"max_epochs={trainer.max_epochs}")
        )
        check_stream(val, reads=reads, because=because)
    if isinstance(spec, StreamSpec):
        check_stream(spec, reads=trainer.max_epochs, because=f"max_epochs={trainer.max_epochs}")
        if spec.self_sharded and strategy.elastic:
            raise ConfigurationError(
                "train_data is a ShardedStream and the strategy is elastic: when the group "
                "changes, each process's share of a stream that shards itself cannot be "
                "re-cut. Let distkit shard the stream (pass it without ShardedStream)"
            )
    if trainer.checkpoints is not None and strategy.is_main:
        trainer.checkpoints.check_writable()  # now, not after the first epoch trained
    found = trainer._pending or _resume.find_resume(
        trainer.resume, trainer.checkpoints, strategy.device, announce=strategy.is_main
    )
    if found is not None:
        epoch_samples = None if plan is None else plan.samples_per_epoch
        _resume.check_fits(found, model, optimizer, samples_of(spec), epoch_samples)
    trainer.callbacks.validate(trainer)
    agreed = {
        "resume from": "no checkpoint" if found is None else found.label,
        "train_data samples": describe_data(spec),
        "batch plan": describe_plan(trainer, spec, plan),
        "val_data samples": "none" if val is None else describe_data(val),
        "model": _agreement.describe_model(model),
        "optimizer": f"{type(optimizer).__name__}, {len(optimizer.param_groups)} group(s)",
        "scheduler": "none" if call.scheduler is None else type(call.scheduler).__name__,
        "settings": f"strategy={strategy.name} {strategy.options}, "
        f"max_epochs={trainer.max_epochs}, max_steps={trainer.max_steps}, seed={trainer.seed}, "
        f"scheduler_interval={trainer.scheduler_interval}, nonfinite={trainer.nonfinite}, "
        f"checkpoint_every={trainer.checkpoint_every}, clip={trainer.gradient_clip}, "
        f"log_every_n_steps={trainer.log_every_n_steps}, "
        f"val_every_n_steps={trainer.val_every_n_steps}, "
        f"compile={describe_compile(trainer.compile)}",
        # called on every rank: the same kinds in the same order (some are collectives)
        "callbacks": trainer.callbacks.describe(),
    }
    details = {"model": lambda: _agreement.named_shapes(model)}
    # each rank's devices of a model the user placed: ranks sharing one GPU are refused
    fit_plan = FitPlan(spec, plan, found, placement)
    return _agreement.Prepared(agreed, fit_plan, shared=placement.claim(), details=details)


def checked_placement(trainer: Trainer, model: nn.Module) -> Placement:
    """Where ``model`` is against this rank's device, with ``Trainer(input_device=...)``;
    raises where the strategy cannot train it there, or where ``input_device`` is given for
    a model distkit places itself."""
    strategy = trainer.strategy
    placement = trainer._setups.placement(model)
    placement.check(strategy.name, strategy.placement_refusal)
    if trainer.input_device is not None and not placement.user_placed:
        raise ConfigurationError(
            f"input_device={str(trainer.input_device)!r} is for a model you placed on devices "
            f"of your own; this model is on {placement.describe()}, so distkit moves it and "
            f"its inputs to this rank's device ({strategy.device}). Leave input_device=None, "
            "or place the model yourself (e.g. its layers on cuda:0 and cuda:1)"
        )
    return dataclasses.replace(placement, override=trainer.input_device)


def samples_of(spec: LoaderSpec | StreamSpec) -> int | None:
    """The samples of an epoch, where known ahead (None: a stream)."""
    return None if isinstance(spec, StreamSpec) else len(spec)


def describe_data(spec: LoaderSpec | StreamSpec) -> str:
    return spec.describe() if isinstance(spec, StreamSpec) else str(len(spec))


def describe_plan(trainer: Trainer, spec: LoaderSpec | StreamSpec, plan: Any) -> str:
    per_step = f"{trainer.grad_accum_steps} accumulated"
    if isinstance(spec, StreamSpec):
        size = "whole batches" if spec.batch_size is None else f"{spec.batch_size} per rank"
        return f"{size} x {per_step}, a stream, drop_last={spec.drop_last or trainer.drop_last}"
    return str(plan.describe())


def batch_plan(trainer: Trainer, spec: LoaderSpec | StreamSpec) -> GlobalBatchPlan | None:
    """The global batches of ``spec``'s data for this rank, at the current world size (None:
    a stream, whose batches are learnt as it goes)."""
    if isinstance(spec, StreamSpec):
        return None
    strategy = trainer.strategy
    common: dict[str, Any] = {
        "world_size": strategy.world_size,
        "rank": strategy.rank,
        "grad_accum_steps": trainer.grad_accum_steps,
        "seed": trainer.seed,
        "drop_last": spec.drop_last or trainer.drop_last,
    }
    # a user's batch sampler or sampler draws the epoch (the same on every rank)
    if spec.batch_sampler is not None:
        return BatchSamplerPlan(spec.batch_sampler, **common)
    if spec.sampler is not None:
        return SamplerPlan(spec.sampler, batch_size=spec.batch_size, **common)
    return GlobalBatchPlan(len(spec), batch_size=spec.batch_size, shuffle=spec.shuffle, **common)


def prepare_evaluate(
    trainer: Trainer, model: nn.Module, data: Any, loss_fn: LossFn | None, metrics: Metrics | None
) -> _agreement.Prepared[tuple[dict[str, Metric], LoaderSpec | StreamSpec, Placement]]:
    check_model(model)
    placement = checked_placement(trainer, model)
    named = named_metrics(metrics)
    if loss_fn is None and not named:
        raise ConfigurationError("evaluate needs a loss_fn, metrics, or both")
    spec = trainer._loader_spec(data, "val_data", shuffle=False)
    agreed = {"data samples": describe_data(spec), "metrics": ", ".join(named) or "none"}
    return _agreement.Prepared(agreed, (named, spec, placement))


def prepare_save(
    strategy: Strategy,
    run: Run | None,
    callbacks: Stateful,
    extra: object,
    path: str | os.PathLike[str] | None,
) -> _agreement.Prepared[dict[str, Any]]:
    """Checks, this rank's state for the file; the local part: the callbacks' states."""
    if run is None:
        raise ConfigurationError("save_checkpoint needs a model: call fit(...) first")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigurationError(
            "extra must be a dict (of tensors, numbers, strings, lists and dicts), got "
            f"{type(extra).__name__}"
        )
    if path is not None:
        check_path("path", path, "a file path (str or os.PathLike)")
        if strategy.is_main and Path(path).is_dir():  # rank 0 writes
            raise ckpt.CheckpointError(
                f"{path} is a folder; a checkpoint is a file: pass a path such as "
                f"{Path(path) / 'model.pt'}"
            )
    shared = _resume.rank_state(run.state)
    states = callbacks.state_dict()  # checked on every rank, before any collective
    return _agreement.Prepared({"global step": str(run.state.global_step)}, states, shared)
