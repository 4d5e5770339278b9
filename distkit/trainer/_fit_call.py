"""What one ``fit(...)`` call was given, as one value that travels down the call.

The Trainer's ``fit`` builds it once from its arguments; the preparation, the set-up and the
loop read what they need from it instead of each taking the same eight arguments again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distkit.runtime._compile import Compiler
from distkit.runtime._evaluation import LossFn, Metrics

#: ``step_fn(model, batch)`` -> the batch's mean loss (for batches of any other layout)
StepFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class FitCall:
    """``fit``'s arguments, and the compiler a compiled model asked for."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_data: Any
    loss_fn: LossFn | None = None
    val_data: Any = None
    metrics: Metrics | None = None
    scheduler: Any = None
    step_fn: StepFn | None = None
    compiler: Compiler | None = None
