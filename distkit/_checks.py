"""Argument checks and small set-up steps of the trainer, with errors that say the fix."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from distkit.errors import ConfigurationError


def check_ints(**values: tuple[Any, int]) -> None:
    for name, (value, low) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"{name} must be an integer >= {low}, got {value!r}")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigurationError(f"{name}={value!r}; allowed: {', '.join(allowed)}")


def check_fit_args(model: object, optimizer: object, loss_fn: object, step_fn: object) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if loss_fn is None and step_fn is None:
        raise ConfigurationError(
            "fit needs loss_fn (called as loss_fn(model(inputs), target)) or step_fn "
            "(called as step_fn(model, batch) and returning the loss)"
        )
    owned = {id(p) for p in model.parameters()}
    foreign = sum(
        1 for group in optimizer.param_groups for p in group["params"] if id(p) not in owned
    )
    if foreign:
        raise ConfigurationError(
            f"the optimizer holds {foreign} tensor(s) that are not parameters of the model; "
            "build it from this model: optimizer = SGD(model.parameters(), ...)"
        )


def seed_generators(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def step_scheduler(scheduler: Any, record: dict[str, float]) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(record.get("val_loss", record["train_loss"]))
    else:
        scheduler.step()
