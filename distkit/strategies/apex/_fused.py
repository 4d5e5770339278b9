"""Swapping a torch optimizer for its apex fused twin, keeping hyper-parameters and state."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from distkit.errors import ConfigurationError


def fused_twin(optimizer: torch.optim.Optimizer, optimizers: ModuleType) -> torch.optim.Optimizer:
    """The apex fused optimizer doing what ``optimizer`` does, over the same param groups.

    The param-group dicts are shared, so an LR scheduler built on ``optimizer`` keeps
    steering the fused one; its state (moments, momentum buffers) is carried over.

    Raises:
        ConfigurationError: no fused twin exists for this optimizer class.
    """
    if type(optimizer).__module__.startswith("apex."):
        return optimizer  # already fused
    groups = optimizer.param_groups
    fused: Any
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        fused = optimizers.FusedAdam(
            groups,
            adam_w_mode=isinstance(optimizer, torch.optim.AdamW),
            **_adam_defaults(optimizer),
        )
        _carry_adam_steps(optimizer)
    elif type(optimizer) is torch.optim.SGD:
        defaults = optimizer.defaults
        fused = optimizers.FusedSGD(
            groups,
            lr=defaults["lr"],
            momentum=defaults["momentum"],
            dampening=defaults["dampening"],
            weight_decay=defaults["weight_decay"],
            nesterov=defaults["nesterov"],
        )
    else:
        raise ConfigurationError(
            f"fused_optimizer=True has no apex twin for {type(optimizer).__name__}; apex fuses "
            "Adam, AdamW and SGD (or pass an apex.optimizers.FusedLAMB yourself). Use "
            "fused_optimizer=False to keep it."
        )
    fused.state = optimizer.state  # one state, visible through both objects
    return fused


def _adam_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    d = optimizer.defaults
    if d.get("maximize") or d.get("amsgrad"):
        raise ConfigurationError(
            "fused_optimizer=True: apex's FusedAdam supports neither maximize nor amsgrad; "
            "use fused_optimizer=False"
        )
    return {"lr": d["lr"], "betas": d["betas"], "eps": d["eps"], "weight_decay": d["weight_decay"]}


def _carry_adam_steps(optimizer: torch.optim.Optimizer) -> None:
    """torch keeps Adam's step per parameter, FusedAdam per group: copy it over on resume."""
    for group in optimizer.param_groups:
        steps = [
            float(optimizer.state[p]["step"])
            for p in group["params"]
            if "step" in optimizer.state[p]
        ]
        if steps:
            group["step"] = int(max(steps))
