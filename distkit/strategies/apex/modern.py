"""Modern apex (>= 25.07, no ``apex.amp`` / ``apex.parallel``): native torch does the rest.

torch autocast + GradScaler (the strategy's
:class:`~distkit.strategies.precision.Precision`) and torch DDP; apex contributes its fused
optimizers, which the strategy swaps in on request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distkit.errors import ApexLegacyApiMissingError
from distkit.strategies import _torch_dist
from distkit.strategies._steps import StepOutcome, gradients_finite, step_gradients
from distkit.strategies.apex._detect import ApexInstall
from distkit.strategies.apex._generation import ApexSettings
from distkit.strategies.apex._levels import resolve_plan
from distkit.strategies.base import Strategy
from distkit.strategies.precision import Precision


class ModernApex:
    """apex without amp: ``opt_level`` is mapped onto torch autocast + GradScaler.

    Raises:
        ApexLegacyApiMissingError: ``strict=True``, which asks for the legacy API.
    """

    def __init__(self, strategy: Strategy, settings: ApexSettings, install: ApexInstall) -> None:
        if settings.strict:  # refused before any opt level is read
            raise ApexLegacyApiMissingError(
                f"strict=True: apex {install.version} has no apex.amp / apex.parallel "
                "(removed in 25.07). Install apex 25.04 for the legacy API, or drop strict=True "
                "to run native autocast + GradScaler + torch DDP with apex's fused optimizers."
            )
        self.plan = resolve_plan(
            strategy.options.precision,
            settings.opt_level,
            legacy=False,
            strict=settings.strict,
            choices=strategy.choices,
        )
        self._strategy = strategy
        self._fused = settings.fused_optimizer

    def describe(self) -> str:
        optimizer = "apex fused optimizers" if self._fused else "the user's optimizer"
        return (
            "apex without apex.amp/apex.parallel (>= 25.07): torch autocast + GradScaler "
            f"+ torch DDP + {optimizer}; {self.plan.note}"
        )

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        strategy = self._strategy
        if strategy.world_size > 1:
            model = _torch_dist.wrap_ddp(
                model,
                strategy.device,
                find_unused_parameters=strategy.options.find_unused_parameters,
            )
        return model, optimizer

    # the precision hooks are the strategy's Precision, as for every native-torch strategy
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return self._strategy.precision.autocast()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self._strategy.precision.scale(loss).backward()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool
    ) -> StepOutcome:
        precision = self._strategy.precision
        if skip_nonfinite and precision.scaler is None and not gradients_finite(optimizer):
            return StepOutcome.SKIPPED_NONFINITE
        return StepOutcome.of(precision.step(optimizer))

    def compile_model(
        self, model: nn.Module, compiler: Callable[[nn.Module], nn.Module]
    ) -> nn.Module:
        return compiler(model)  # torch DDP's documented order: compile the wrapper

    def finalize_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self._strategy.precision.unscale_(optimizer)  # torch DDP averaged in backward

    def gradients(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return step_gradients(optimizer)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def make_precision(self, device: torch.device) -> Precision:
        return Precision(self.plan.precision, device)  # torch's autocast and GradScaler

    def close(self) -> None:
        pass  # fused optimizers and torch's amp: nothing patched outside the model
