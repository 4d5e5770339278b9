"""Legacy apex (<= 25.04): ``apex.amp`` casts and scales, apex's DDP averages.

The order is the one apex requires: sync BatchNorm conversion (done by the strategy, torch's
masked layer) -> ``amp.initialize`` -> ``apex.parallel.DistributedDataParallel``. Backward goes
through ``amp.scale_loss``, accumulation through apex DDP's allreduce switch, and amp's loss
scaler is checkpointed in torch ``GradScaler`` form (converted here, both ways), so
checkpoints move between apex and the other strategies.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit.errors import UnsupportedFeatureError
from distkit.strategies import _torch_dist
from distkit.strategies._steps import StepOutcome, gradients_finite
from distkit.strategies.apex._detect import ApexInstall
from distkit.strategies.apex._generation import ApexSettings
from distkit.strategies.apex._levels import resolve_plan
from distkit.strategies.apex._o1_patches import O1Patches
from distkit.strategies.base import Strategy
from distkit.strategies.precision import Precision


def amp_to_grad_scaler(amp_state: Mapping[str, Any]) -> dict[str, Any]:
    """apex ``amp.state_dict()`` -> torch ``GradScaler.state_dict()`` form."""
    scaler = amp_state.get("loss_scaler0")
    if not scaler:
        return {}
    return {
        "scale": float(scaler["loss_scale"]),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": int(scaler.get("unskipped", 0)),
    }


def grad_scaler_to_amp(scaler_state: Mapping[str, Any]) -> dict[str, Any]:
    """torch ``GradScaler.state_dict()`` -> apex ``amp.state_dict()`` form."""
    if not scaler_state:
        return {}
    return {
        "loss_scaler0": {
            "loss_scale": float(scaler_state["scale"]),
            "unskipped": int(scaler_state.get("_growth_tracker", 0)),
        }
    }


class AmpScalerPrecision(Precision):
    """Legacy apex's precision: amp scales the loss itself, so the scaler state a checkpoint
    holds is amp's, converted to and from torch's ``GradScaler`` form (any strategy's
    checkpoint then resumes here, and this one anywhere)."""

    def __init__(self, precision: str, device: torch.device, amp: Any) -> None:
        super().__init__(precision, device)
        self._amp = amp

    @override
    def state_dict(self) -> dict[str, Any]:
        return amp_to_grad_scaler(self._amp.state_dict())

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        amp_state = grad_scaler_to_amp(state or {})
        if amp_state:
            self._amp.load_state_dict(amp_state)  # after amp.initialize (apex requires it)


class LegacyApex:
    """apex with ``amp`` and ``parallel``: amp at the opt level, apex DDP for several ranks."""

    def __init__(self, strategy: Strategy, settings: ApexSettings, install: ApexInstall) -> None:
        self.plan = resolve_plan(
            strategy.options.precision, settings.opt_level, legacy=True, strict=settings.strict
        )
        self._strategy = strategy
        self._settings = settings
        self._amp = importlib.import_module("apex.amp")
        self._parallel = importlib.import_module("apex.parallel")
        self._accumulating = False  # inside no_sync: amp leaves the gradients scaled
        self._overflowed = False  # the last unscaling backward made amp skip the next step
        self._o1: O1Patches | None = None  # O1's torch patches, in place only in forwards

    def describe(self) -> str:
        return f"legacy apex: apex.amp + apex.parallel.DistributedDataParallel; {self.plan.note}"

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self._strategy.options.find_unused_parameters:
            raise UnsupportedFeatureError(
                "apex.parallel.DistributedDataParallel has no find_unused_parameters; its "
                "allreduce waits for every parameter. Use "
                f"strategy={_torch_dist.native_alternative()!r} (torch DDP) for models that "
                "skip parameters, or make every parameter take part."
            )
        # apex requires amp.initialize before its DDP wrapper, never after
        model, optimizer = self._amp.initialize(
            model,
            optimizer,
            opt_level=self.plan.opt_level,
            keep_batchnorm_fp32=self._settings.keep_batchnorm_fp32,
            loss_scale=self._settings.loss_scale,
        )
        self._o1 = O1Patches.take(getattr(self._amp_state(), "handle", None))
        if self._strategy.world_size > 1:
            model = self._parallel.DistributedDataParallel(
                model, delay_allreduce=self._settings.delay_allreduce
            )
        return model, optimizer

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        # amp casts: O1 through its patched torch functions, in place for this block only
        # (see _o1_patches); O2/O3 through the fp16 model
        return contextlib.nullcontext() if self._o1 is None else self._o1.active()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        before = self._loss_scale()
        # unscaling waits for the last micro-batch of an accumulation window
        with self._amp.scale_loss(loss, optimizer, delay_unscale=self._accumulating) as scaled:
            scaled.backward()
        # amp halves a dynamic scale exactly when it overflows and patches the next
        # optimizer.step() into a skip (distkit sets no min_loss_scale); a static scale never
        # skips. So a lower scale is the public sign of a skip.
        self._overflowed = self._loss_scale() < before

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool
    ) -> StepOutcome:
        overflowed, self._overflowed = self._overflowed, False
        if overflowed:
            # amp patched this step into a skip: call it, or the armed skip would swallow
            # the next real step (and distkit would count that one as taken)
            optimizer.step()
            return StepOutcome.SKIPPED_OVERFLOW
        if skip_nonfinite and not gradients_finite(optimizer):
            return StepOutcome.SKIPPED_NONFINITE  # amp armed nothing (e.g. a static scale)
        optimizer.step()
        return StepOutcome.STEPPED

    def compile_model(
        self, model: nn.Module, compiler: Callable[[nn.Module], nn.Module]
    ) -> nn.Module:
        raise UnsupportedFeatureError(
            "compile=True with legacy apex amp: amp casts by patching torch functions (O1) "
            "or the model (O2) at run time, behind torch.compile's back, and apex's DDP "
            "registers hooks dynamo does not trace. Use compile=False with apex, or "
            "strategy='ddp' with precision='fp16'/'bf16' (torch's amp), which compiles."
        )

    def finalize_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # apex DDP averaged in backward; amp unscaled into the master gradients there

    def gradients(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        # amp's documented clipping target: the fp32 master parameters (O2 keeps them apart)
        return [p.grad for p in self._amp.master_params(optimizer) if p.grad is not None]

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # apex DDP has no no_sync(); it has an allreduce switch
        apex_ddp: Any = model if isinstance(model, self._parallel.DistributedDataParallel) else None
        if apex_ddp is not None:
            apex_ddp.disable_allreduce()
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False
            if apex_ddp is not None:
                apex_ddp.enable_allreduce()

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, self._parallel.DistributedDataParallel):
            inner: nn.Module = model.module
            return inner
        return model

    def make_precision(self, device: torch.device) -> Precision:
        return AmpScalerPrecision(self.plan.precision, device, self._amp)

    def close(self) -> None:
        """Forget O1's patches (they are in place only inside :meth:`autocast`) and empty
        amp's cast cache, which holds this model's fp16 copies."""
        self._o1 = None
        clear = getattr(getattr(self._amp_state(), "handle", None), "_clear_cache", None)
        if callable(clear):
            clear()

    def _amp_state(self) -> Any:
        """apex's process-wide amp state (``apex.amp._amp_state``: apex re-binds the module's
        name to the object; either is accepted)."""
        state = getattr(self._amp, "_amp_state", None)
        return getattr(state, "_amp_state", state)

    def _loss_scale(self) -> float:
        return float(self._amp.state_dict()["loss_scaler0"]["loss_scale"])
