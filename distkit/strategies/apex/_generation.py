"""What the user asked of apex, and what each apex generation implements."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from distkit.strategies._steps import StepOutcome
from distkit.strategies.apex._levels import ApexPlan
from distkit.strategies.precision import Precision


@dataclass(frozen=True)
class ApexSettings:
    """:class:`~distkit.strategies.apex.ApexStrategy`'s apex options, as given."""

    opt_level: str | None = None
    delay_allreduce: bool = False
    keep_batchnorm_fp32: bool | None = None
    loss_scale: float | str | None = None
    fused_optimizer: bool = False
    strict: bool = False


class Generation(Protocol):
    """The hooks in which legacy and modern apex differ; ``ApexStrategy`` forwards to one.

    Each generation is created once apex is detected, from the strategy (for its topology,
    options and precision), the :class:`ApexSettings` and the install; it refuses settings it
    cannot honour there. Its state hooks speak the neutral form (a ``"scaler"`` entry in
    torch ``GradScaler`` form), whatever the generation keeps internally.
    """

    plan: ApexPlan

    def describe(self) -> str:
        """Which apex path runs and how the opt level was read (the start-up message)."""
        ...

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]: ...

    def autocast(self) -> contextlib.AbstractContextManager[None]: ...

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None: ...

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool
    ) -> StepOutcome: ...

    def finalize_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Averaged, unscaled gradients in place before clipping (see Strategy's hook)."""
        ...

    def compile_model(
        self, model: nn.Module, compiler: Callable[[nn.Module], nn.Module]
    ) -> nn.Module:
        """``torch.compile`` the set-up model, or refuse where this generation cannot."""
        ...

    def gradients(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The gradients the step applies: the fp32 master parameters' where amp keeps them."""
        ...

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]: ...

    def unwrap(self, model: nn.Module) -> nn.Module: ...

    def make_precision(self, device: torch.device) -> Precision:
        """The strategy's precision: autocast, loss scaler, and the scaler's state in
        ``GradScaler`` form (the checkpoint's neutral form)."""
        ...

    def close(self) -> None:
        """Undo what this generation changed outside the model and optimizer (the Trainer
        is closing)."""
        ...
