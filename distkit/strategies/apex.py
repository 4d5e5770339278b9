"""NVIDIA apex, both generations, launched like DDP (torchrun / torch.distributed.launch).

* Legacy apex (<= 25.04): sync BatchNorm conversion (torch's masked SyncBatchNorm, not
  ``convert_syncbn_model``) -> ``amp.initialize`` -> apex ``DistributedDataParallel``,
  backward through ``amp.scale_loss``, accumulation through apex DDP's allreduce switch,
  ``amp.state_dict()`` checkpointed.
* Modern apex (>= 25.07, no ``apex.amp`` / ``apex.parallel``): torch autocast + GradScaler +
  torch DDP, with apex's fused optimizers swapped in on request.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distkit._env import LaunchEnv
from distkit.errors import (
    ApexLegacyApiMissingError,
    ApexNeedsCudaError,
    ConfigurationError,
    UnsupportedFeatureError,
)
from distkit.strategies import _torch_dist
from distkit.strategies._apex_detect import ApexInstall, detect_apex
from distkit.strategies._apex_fused import fused_twin
from distkit.strategies._apex_levels import ApexPlan, resolve_plan
from distkit.strategies.base import Strategy, Topology


def _require_cuda() -> None:
    """apex is CUDA-only; say so before anything else happens."""
    if not torch.cuda.is_available():
        raise ApexNeedsCudaError(
            "strategy='apex' needs CUDA: NVIDIA apex (amp, its DDP, fused optimizers) runs on "
            "GPUs only, and no CUDA device is available here. On CPU use strategy='ddp' with "
            "precision='bf16' (or 'fp16'): the same script, native autocast instead of amp."
        )


class ApexStrategy(_torch_dist.TorchDistributedCollectives, Strategy):
    """NVIDIA apex data parallelism; says at start-up which apex path runs.

    Args:
        opt_level: ``"O0"``-``"O3"``; ``None`` follows the Trainer's precision ("32" -> O0,
            "fp16" -> O1). Contradictions with the precision are refused.
        delay_allreduce: legacy apex DDP's option (all-reduce once, after backward).
        keep_batchnorm_fp32, loss_scale: passed to ``amp.initialize`` (legacy).
        fused_optimizer: swap Adam/AdamW/SGD for apex's FusedAdam/FusedSGD.
        strict: refuse to fall back to native torch when apex lacks ``amp`` / ``parallel``.
        backend, timeout: as for :class:`~distkit.strategies.ddp.DDPStrategy`.
    """

    name = "apex"

    def __init__(
        self,
        *,
        opt_level: str | None = None,
        delay_allreduce: bool = False,
        keep_batchnorm_fp32: bool | None = None,
        loss_scale: float | str | None = None,
        fused_optimizer: bool = False,
        strict: bool = False,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> None:
        super().__init__()
        self.opt_level = opt_level
        self.delay_allreduce = delay_allreduce
        self.keep_batchnorm_fp32 = keep_batchnorm_fp32
        self.loss_scale = loss_scale
        self.fused_optimizer = fused_optimizer
        self.strict = strict
        self.backend = backend
        self.timeout = _torch_dist.as_timeout(timeout)
        self.install: ApexInstall | None = None
        self.plan: ApexPlan | None = None
        self._owns_group = False
        self._accumulating = False

    # ------------------------------------------------------------------ set-up
    def _setup_environment(self) -> Topology:
        _require_cuda()
        self.install = detect_apex()
        legacy = self.install.has_legacy_api
        if self.strict and not legacy:
            raise ApexLegacyApiMissingError(
                f"strict=True: apex {self.install.version} has no apex.amp / apex.parallel "
                "(removed in 25.07). Install apex 25.04 for the legacy API, or drop strict=True "
                "to run native autocast + GradScaler + torch DDP with apex's fused optimizers."
            )
        self.plan = resolve_plan(
            self.options.precision, self.opt_level, legacy=legacy, strict=self.strict
        )
        topology, self._owns_group = _torch_dist.init_process_group(
            LaunchEnv.detect(),
            backend=self.backend,
            timeout=_torch_dist.resolve_timeout(self.timeout, self.options.collective_timeout),
            strategy=self.name,
        )
        if topology.rank == 0:
            warnings.warn(self.describe(), stacklevel=2)
        return topology

    def describe(self) -> str:
        """One line: which apex path runs, and how the opt level was read."""
        assert self.install is not None and self.plan is not None
        if self.install.has_legacy_api:
            path = "legacy apex: apex.amp + apex.parallel.DistributedDataParallel"
        else:
            fused = "apex fused optimizers" if self.fused_optimizer else "the user's optimizer"
            path = (
                "apex without apex.amp/apex.parallel (>= 25.07): torch autocast + GradScaler "
                f"+ torch DDP + {fused}"
            )
        return f"distkit apex ({self.install.version}): {path}; {self.plan.note}"

    def _precision_name(self) -> str:
        return self.plan.precision if self.plan is not None else self.options.precision

    def teardown(self) -> None:
        if self._owns_group:
            _torch_dist.destroy_process_group()
            self._owns_group = False
        super().teardown()

    def _module(self, name: str) -> ModuleType:
        return importlib.import_module(name)

    @property
    def _legacy(self) -> bool:
        return self.install is not None and self.install.has_legacy_api

    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        # torch's SyncBatchNorm (masked) for both generations, not legacy apex's
        # convert_syncbn_model: apex.parallel.SyncBatchNorm has no way to count a placeholder
        # sample as none (it takes no empty batch), so uneven last batches would normalise
        # wrongly. Converting before amp.initialize keeps the order apex requires.
        return _torch_dist.convert_sync_batchnorm(model, self.device)

    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        assert self.plan is not None
        if self.fused_optimizer:
            optimizer = fused_twin(optimizer, self._module("apex.optimizers"))
        if self._legacy:
            if self.options.find_unused_parameters:
                raise UnsupportedFeatureError(
                    "apex.parallel.DistributedDataParallel has no find_unused_parameters; its "
                    "allreduce waits for every parameter. Use strategy='ddp' (torch DDP) for "
                    "models that skip parameters, or make every parameter take part."
                )
            # apex requires amp.initialize before its DDP wrapper, never after
            amp = self._module("apex.amp")
            model, optimizer = amp.initialize(
                model, optimizer, opt_level=self.plan.opt_level,
                keep_batchnorm_fp32=self.keep_batchnorm_fp32, loss_scale=self.loss_scale,
            )  # fmt: skip
            if self.world_size > 1:
                parallel = self._module("apex.parallel")
                model = parallel.DistributedDataParallel(
                    model, delay_allreduce=self.delay_allreduce
                )
            return model, optimizer
        if self.world_size > 1:
            model = _torch_dist.wrap_ddp(
                model, self.device, find_unused_parameters=self.options.find_unused_parameters
            )
        return model, optimizer

    # ------------------------------------------------------------------ training hooks
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self._legacy:
            return contextlib.nullcontext()  # amp casts (patched functions or fp16 model)
        return super().autocast()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        if not self._legacy:
            super().backward(loss, optimizer)
            return
        amp = self._module("apex.amp")
        # unscaling waits for the last micro-batch of an accumulation window
        with amp.scale_loss(loss, optimizer, delay_unscale=self._accumulating) as scaled:
            scaled.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self._legacy:
            return super().optimizer_step(optimizer)
        scalers = getattr(self._module("apex.amp._amp_state"), "loss_scalers", [])
        overflow = bool(scalers and getattr(scalers[0], "_has_overflow", False))
        optimizer.step()  # amp's patched step skips itself after an overflow
        if overflow:
            self.precision.skipped_steps += 1
        return not overflow

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if self._legacy:
            return self._apex_no_sync(model)
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _apex_no_sync(self, model: nn.Module) -> Iterator[None]:
        # apex DDP has no no_sync(); it has an allreduce switch
        switch = hasattr(model, "disable_allreduce")
        if switch:
            model.disable_allreduce()  # type: ignore[operator]
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False
            if switch:
                model.enable_allreduce()  # type: ignore[operator]

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, DistributedDataParallel):
            return model.module
        if self._legacy and isinstance(
            model, self._module("apex.parallel").DistributedDataParallel
        ):
            inner: nn.Module = model.module
            return inner
        return model

    def state_dict(self) -> dict[str, Any]:
        if not self._legacy:
            return super().state_dict()
        return {"scaler": {}, "amp": self._module("apex.amp").state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self._legacy:
            super().load_state_dict(state)
            return
        if state.get("amp"):
            self._module("apex.amp").load_state_dict(state["amp"])  # after amp.initialize
        elif state.get("scaler"):
            raise ConfigurationError(
                "this state holds a torch GradScaler, not apex.amp's loss scaler; load it "
                "through distkit's checkpoint functions, which convert between the two"
            )
