"""Argument checks of the Trainer and its calls, each error naming what was given and the fix."""

from __future__ import annotations

from typing import Any

import torch

from distkit._validate import (
    check_choice,
    check_flags,
    check_ints,
    check_path,
    check_positive,
)
from distkit.errors import ConfigurationError
from distkit.runtime import check_model, check_not_set_up, foreign_tensors

SCHEDULER_INTERVALS = ("epoch", "step")
NONFINITE_POLICIES = ("raise", "skip")


def check_fit_args(
    model: object,
    optimizer: object,
    loss_fn: object,
    step_fn: object,
    groups: list[list[torch.Tensor]] | None = None,
) -> None:
    """``fit``'s arguments; ``groups``: the optimizer's parameters as the strategy counts
    them (None: its own ``param_groups``)."""
    model = check_model(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    check_not_set_up(optimizer, "fit's optimizer")
    for name, fn in (("loss_fn", loss_fn), ("step_fn", step_fn)):
        if fn is not None and not callable(fn):
            raise ConfigurationError(f"{name} must be callable, got {type(fn).__name__}")
    if loss_fn is None and step_fn is None:
        raise ConfigurationError(
            "fit needs loss_fn (called as loss_fn(model(inputs), target)) or step_fn "
            "(called as step_fn(model, batch) and returning the loss)"
        )
    if groups is None:
        groups = [list(group["params"]) for group in optimizer.param_groups]
    foreign = foreign_tensors(model, (p for group in groups for p in group))
    if foreign:
        raise ConfigurationError(
            f"the optimizer holds {foreign} tensor(s) that are not parameters of the model; "
            "build it from this model: optimizer = SGD(model.parameters(), ...)"
        )


def check_scheduler(scheduler: object, optimizer: torch.optim.Optimizer, *, per_step: bool) -> None:
    """An LR scheduler of ``optimizer`` that can step at the chosen interval."""
    if scheduler is None:
        return
    if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict")):
        raise ConfigurationError(
            f"scheduler must be a torch LR scheduler (with step() and state_dict()), got "
            f"{type(scheduler).__name__}: e.g. torch.optim.lr_scheduler.StepLR(optimizer, 10)"
        )
    owner = getattr(scheduler, "optimizer", optimizer)
    if owner is not optimizer:
        raise ConfigurationError(
            f"the scheduler steps another optimizer ({type(owner).__name__} at "
            f"{id(owner):#x}) than the one passed to fit ({type(optimizer).__name__} at "
            f"{id(optimizer):#x}), so it would change nothing; build it on fit's optimizer"
        )
    if per_step and isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigurationError(
            "ReduceLROnPlateau steps on a validation metric, once per epoch, but "
            "scheduler_interval='step' would step it after every optimizer step without one. "
            "Use scheduler_interval='epoch' (it then steps on val_loss, or train_loss)"
        )


def check_validation(
    val_data: object,
    loss_fn: object,
    metrics: object,
    val_every_n_steps: int | None = None,
    step_fn: object = None,
) -> None:
    """What fit evaluates after each epoch is computable (checked before the first epoch)."""
    if val_data is None and val_every_n_steps is not None:
        raise ConfigurationError(
            f"Trainer(val_every_n_steps={val_every_n_steps}) validates val_data every "
            f"{val_every_n_steps} steps, and this fit has no val_data: pass val_data=... to "
            "fit, or leave val_every_n_steps=None on a Trainer that fits without validation"
        )
    if val_data is None and metrics:
        raise ConfigurationError(
            "metrics are computed on val_data, and no val_data was given: pass "
            "val_data=... to fit, or call trainer.evaluate(model, data, metrics=...) yourself"
        )
    if step_fn is not None and not callable(step_fn):
        raise ConfigurationError(f"eval_step_fn must be callable, got {type(step_fn).__name__}")
    if val_data is not None and loss_fn is None and step_fn is None and not metrics:
        raise ConfigurationError(
            "val_data needs a loss_fn, a step_fn (fit's, or eval_step_fn=...), metrics, or "
            "a mix to compute after each epoch: pass loss_fn=..., step_fn=... or metrics=..."
        )


def check_trainer_arguments(args: dict[str, Any]) -> None:
    """``Trainer(...)``'s arguments, each with an error that names it and the fix."""
    check_positive("gradient_clip_norm", args["gradient_clip_norm"])
    check_positive("gradient_clip_value", args["gradient_clip_value"])
    lows = {
        "max_epochs": 0,
        "batch_size": 1,
        "num_workers": 0,
        "keep_last": 1,
        "log_every_n_steps": 1,
    }
    check_ints(**{name: (args[name], low) for name, low in lows.items()})
    for name in ("max_steps", "val_every_n_steps"):
        if args[name] is not None:
            check_ints(**{name: (args[name], 1)})
    if args["checkpoint_every"] != "epoch":
        check_ints(checkpoint_every=(args["checkpoint_every"], 1))
    check_choice("scheduler_interval", args["scheduler_interval"], SCHEDULER_INTERVALS)
    check_choice("nonfinite", args["nonfinite"], NONFINITE_POLICIES)
    flags = (
        "shuffle",
        "progress",
        "drop_last",
        "cudnn_benchmark",
        "checkpoint_async",
    )
    check_flags(**{name: args[name] for name in flags})
    check_path("resume", args["resume"], "'auto', a checkpoint path, or None")
    check_path(
        "checkpoint_dir", args["checkpoint_dir"], "a folder path (str or os.PathLike) or None"
    )
    if str(args["resume"]) == "auto" and args["checkpoint_dir"] is None:
        raise ConfigurationError("resume='auto' needs checkpoint_dir=... to look in")
    if args["checkpoint_async"] and args["checkpoint_dir"] is None:
        raise ConfigurationError(
            "checkpoint_async=True persists the fit's checkpoints in the background, and this "
            "trainer saves none: pass checkpoint_dir=... too (save_checkpoint(path) always "
            "writes before it returns)"
        )
