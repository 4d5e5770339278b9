"""Argument checks of the Runtime and its calls, each error naming what was given and the fix."""

from __future__ import annotations

import torch
from torch import nn

from distkit.errors import ConfigurationError
from distkit.runtime._set_up import SetUpOptimizer, foreign_tensors


def check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def check_setup_args(model: object, optimizers: tuple[object, ...]) -> None:
    """``rt.setup(model, *optimizers)``: a module, and optimizers over its parameters."""
    model = check_model(model)
    for position, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                f"rt.setup's optimizer #{position + 1} must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        check_not_set_up(optimizer, f"rt.setup's optimizer #{position + 1}")
        foreign = foreign_tensors(model, (p for g in optimizer.param_groups for p in g["params"]))
        if foreign:
            raise ConfigurationError(
                f"optimizer #{position + 1} holds {foreign} tensor(s) that are not parameters "
                "of the model; set up each model with its own optimizers: "
                "rt.setup(model, torch.optim.SGD(model.parameters(), ...))"
            )


def check_not_set_up(optimizer: torch.optim.Optimizer, what: str) -> None:
    if isinstance(optimizer, SetUpOptimizer):
        raise ConfigurationError(
            f"{what} is one that rt.setup returned (a {type(optimizer).__name__}): it is set "
            "up already. "
            "Pass the optimizer you built (set up once), or keep using the set-up one in "
            "your loop"
        )


def check_loss(loss: object, source: str) -> None:
    """What loss_fn / step_fn returned can be backpropagated (checked every micro-batch)."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigurationError(
            f"{source} returned a {type(loss).__name__}, not a tensor: return the batch-mean "
            "loss as a scalar torch.Tensor computed from the model's output"
        )
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ConfigurationError(
            f"{source} returned a tensor that does not require grad, so backward cannot reach "
            "the model: compute it from the model's output, without .item(), .detach() or "
            "torch.no_grad()"
        )
