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

from distkit.runtime import Compiler, LossFn, Metrics

#: ``step_fn(model, batch)`` -> the batch's mean loss, a ``distkit.Loss`` (a sum and its
#: item count: token-exact), or a model's output with ``.loss`` (for batches of any layout)
StepFn = Callable[[nn.Module, Any], Any]


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
    #: validation's step function (None: ``step_fn`` where fit trains with one)
    eval_step_fn: Callable[[nn.Module, Any], Any] | None = None

    @property
    def validation_step(self) -> Callable[[nn.Module, Any], Any] | None:
        """What validation calls per batch instead of ``loss_fn`` (None: ``loss_fn``)."""
        if self.eval_step_fn is not None:
            return self.eval_step_fn
        return self.step_fn if self.loss_fn is None else None
