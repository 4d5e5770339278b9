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
from distkit.launch import native_alternative
from distkit.strategies._steps import StepOutcome, gradients_finite
from distkit.strategies.apex._detect import ApexInstall
from distkit.strategies.apex._generation import ApexSettings
from distkit.strategies.apex._levels import resolve_plan
from distkit.strategies.apex._o1_patches import O1Patches
from distkit.strategies.base import Strategy
from distkit.strategies.precision import Precision


def amp_to_grad_scaler(amp_state: Mapping[str, Any]) -> dict[str, Any]:
    """apex ``amp.state_dict()`` -> torch ``GradScaler.state_dict()`` form.

    The form holds amp's first loss scaler; with several (``num_losses``: one per optimizer
    of a user's loop) every one is kept under ``"amp_loss_scalers"`` too, a key torch's
    ``GradScaler`` ignores, so that legacy apex resumes each scale exactly.
    """
    scaler = amp_state.get("loss_scaler0")
    if not scaler:
        return {}
    form: dict[str, Any] = {
        "scale": float(scaler["loss_scale"]),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": int(scaler.get("unskipped", 0)),
    }
    if len(amp_state) > 1:
        form["amp_loss_scalers"] = [
            [float(one["loss_scale"]), int(one.get("unskipped", 0))]
            for key, one in amp_state.items()
            if key.startswith("loss_scaler")
        ]
    return form


def grad_scaler_to_amp(scaler_state: Mapping[str, Any]) -> dict[str, Any]:
    """torch ``GradScaler.state_dict()`` -> apex ``amp.state_dict()`` form."""
    if not scaler_state:
        return {}
    several = scaler_state.get("amp_loss_scalers")
    if several:
        return {
            f"loss_scaler{i}": {"loss_scale": float(scale), "unskipped": int(unskipped)}
            for i, (scale, unskipped) in enumerate(several)
        }
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
            strategy.options.precision,
            settings.opt_level,
            legacy=True,
            strict=settings.strict,
            choices=strategy.choices,
        )
        self._strategy = strategy
        self._settings = settings
        self._amp = importlib.import_module("apex.amp")
        self._parallel = importlib.import_module("apex.parallel")
        self._accumulating = False  # inside no_sync: amp leaves the gradients scaled
        #: the optimizers (by id) whose next step amp made a skip (their loss overflowed)
        self._overflowed: set[int] = set()
        self._initialized = False  # amp.initialize ran (apex allows it once)
        self._loss_ids: dict[int, int] = {}  # optimizer id -> its loss scaler (num_losses)
        self._o1: O1Patches | None = None  # O1's torch patches, in place only in forwards

    def describe(self) -> str:
        return f"legacy apex: apex.amp + apex.parallel.DistributedDataParallel; {self.plan.note}"

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        [(wrapped, [amp_optimizer])] = self.setup_together([model], [[optimizer]])
        return wrapped, amp_optimizer

    def setup_together(
        self, models: list[nn.Module], optimizers: list[list[torch.optim.Optimizer]]
    ) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        """Every model and optimizer through one ``amp.initialize`` (apex allows one call:
        it patches torch and each optimizer once), with one loss scaler per optimizer
        (``num_losses``), then each model in apex's DDP."""
        if self._initialized:
            raise UnsupportedFeatureError(
                "legacy apex amp is initialised once per process (amp.initialize takes every "
                "model and optimizer in one call, and patches torch and the optimizers once): "
                "set every model up before the first forward (rt.setup(gen, opt_g); "
                "rt.setup(disc, opt_d); then the loop), or train the later model in a new "
                "process"
            )
        if self._strategy.options.find_unused_parameters:
            instead = native_alternative(self._strategy.choices)
            raise UnsupportedFeatureError(
                "apex.parallel.DistributedDataParallel has no find_unused_parameters; its "
                "allreduce waits for every parameter. Use "
                f"strategy={instead!r} (torch DDP) for models that "
                "skip parameters, or make every parameter take part."
            )
        flat = [opt for opts in optimizers for opt in opts]
        # apex requires amp.initialize before its DDP wrapper, never after
        initialized = self._amp.initialize(
            list(models),
            list(flat) if flat else None,
            opt_level=self.plan.opt_level,
            keep_batchnorm_fp32=self._settings.keep_batchnorm_fp32,
            loss_scale=self._settings.loss_scale,
            num_losses=max(1, len(flat)),
        )
        amp_models, amp_flat = initialized if flat else (initialized, [])
        self._initialized = True
        self._loss_ids = {id(opt): i for i, opt in enumerate(amp_flat)}
        self._o1 = O1Patches.take(getattr(self._amp_state(), "handle", None))
        out: list[tuple[nn.Module, list[torch.optim.Optimizer]]] = []
        start = 0
        for model, opts in zip(amp_models, optimizers, strict=True):
            if self._strategy.world_size > 1:
                model = self._parallel.DistributedDataParallel(
                    model, delay_allreduce=self._settings.delay_allreduce
                )
            out.append((model, list(amp_flat[start : start + len(opts)])))
            start += len(opts)
        return out

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        # amp casts: O1 through its patched torch functions, in place for this block only
        # (see _o1_patches); O2/O3 through the fp16 model
        return contextlib.nullcontext() if self._o1 is None else self._o1.active()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        loss_id = self._loss_ids.get(id(optimizer), 0)
        before = self._loss_scale(loss_id)
        # unscaling waits for the last micro-batch of an accumulation window
        with self._amp.scale_loss(
            loss, optimizer, loss_id=loss_id, delay_unscale=self._accumulating
        ) as scaled:
            scaled.backward()
        # amp halves a dynamic scale exactly when it overflows and patches the optimizer's
        # next step() into a skip (distkit sets no min_loss_scale); a static scale never
        # skips. So a lower scale is the public sign of a skip.
        if self._loss_scale(loss_id) < before:
            self._overflowed.add(id(optimizer))

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool
    ) -> StepOutcome:
        if id(optimizer) in self._overflowed:
            self._overflowed.discard(id(optimizer))
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

    def _loss_scale(self, loss_id: int) -> float:
        return float(self._amp.state_dict()[f"loss_scaler{loss_id}"]["loss_scale"])
