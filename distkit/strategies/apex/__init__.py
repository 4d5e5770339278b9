"""NVIDIA apex, both generations, launched like DDP (torchrun / torch.distributed.launch).

:class:`ApexStrategy` is the one ``strategy="apex"``. Which apex is installed is only known once
it is probed (after the CUDA check, in ``setup_environment``); then it hands the hooks in
which the generations differ to one of two small classes:

* :class:`~distkit.strategies.apex.legacy.LegacyApex` (apex <= 25.04): ``amp.initialize`` ->
  apex ``DistributedDataParallel``, backward through ``amp.scale_loss``;
* :class:`~distkit.strategies.apex.modern.ModernApex` (apex >= 25.07, no ``apex.amp`` /
  ``apex.parallel``): torch autocast + GradScaler + torch DDP.

Both get apex's fused optimizers on request. The process group, the collectives and sync
BatchNorm are the same for both, and stay here.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
from torch import nn
from typing_extensions import override

from distkit.errors import ApexNeedsCudaError, DistkitError
from distkit.launch import StrategyChoices, native_alternative
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.launch.families import TORCH_LAUNCHERS
from distkit.strategies import _torch_dist, _torch_group
from distkit.strategies._placement import place
from distkit.strategies._steps import GradientClip, clip_, local_norm, scale_
from distkit.strategies.apex import _doctor
from distkit.strategies.apex._detect import ApexInstall, detect_apex
from distkit.strategies.apex._fused import fused_twin
from distkit.strategies.apex._generation import ApexSettings, Generation
from distkit.strategies.apex.legacy import LegacyApex
from distkit.strategies.apex.modern import ModernApex
from distkit.strategies.base import StepOutcome, Strategy, Topology
from distkit.strategies.precision import Precision

#: the class of each generation :func:`~distkit.strategies.apex._detect.detect_apex` reports
GENERATIONS: dict[str, Callable[[Strategy, ApexSettings, ApexInstall], Generation]] = {
    "legacy": LegacyApex,
    "modern": ModernApex,
}


def _require_cuda(choices: StrategyChoices) -> None:
    """apex is CUDA-only; say so before anything else happens."""
    if not torch.cuda.is_available():
        raise ApexNeedsCudaError(
            "strategy='apex' needs CUDA: NVIDIA apex (amp, its DDP, fused optimizers) runs on "
            "GPUs only, and no CUDA device is available here. On CPU use "
            f"strategy={native_alternative(choices)!r} with precision='bf16' (or 'fp16'): "
            "the same script, native autocast instead of amp."
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
    launcher = TORCH_LAUNCHERS
    libraries = ("apex",)
    placement_refusal = (
        "apex's amp keeps its fp32 master weights and loss scaler on this rank's GPU and its "
        "DistributedDataParallel expects the whole model there"
    )

    @override
    @classmethod
    def diagnose(cls, machine: MachineFacts) -> StrategyReport:
        """The installed apex, classified by its subpackages (never by running it)."""
        return _doctor.verdict(cls.name, machine, _doctor.probe())

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
        self.settings = ApexSettings(
            opt_level=opt_level,
            delay_allreduce=delay_allreduce,
            keep_batchnorm_fp32=keep_batchnorm_fp32,
            loss_scale=loss_scale,
            fused_optimizer=fused_optimizer,
            strict=strict,
        )
        self.backend = backend
        self.timeout = _torch_group.as_timeout(timeout)
        self.install: ApexInstall | None = None
        self._generation: Generation | None = None

    # ------------------------------------------------------------------ set-up
    @override
    def _setup_environment(self) -> Topology:
        _require_cuda(self.choices)
        self.install = detect_apex()
        self._generation = GENERATIONS[self.install.generation](self, self.settings, self.install)
        topology = self._join_group()
        if topology.rank == 0:
            warnings.warn(self.describe(), stacklevel=2)
        return topology

    @property
    def generation(self) -> Generation:
        """The installed apex generation's hooks (chosen in ``setup_environment``)."""
        if self._generation is None:
            raise DistkitError(
                "strategy 'apex' has not probed apex yet: call setup_environment() first "
                "(distkit.Trainer does this when it is created)"
            )
        return self._generation

    def describe(self) -> str:
        """One line: which apex path runs, and how the opt level was read."""
        path = self.generation.describe()
        assert self.install is not None  # probed with the generation
        return f"distkit apex ({self.install.version}): {path}"

    @override
    def _make_precision(self, device: torch.device) -> Precision:
        return self.generation.make_precision(device)

    @override
    def teardown(self) -> None:
        if self._generation is not None:
            self._generation.close()
        self._leave_group()
        super().teardown()

    @override
    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        # torch's SyncBatchNorm (masked) for both generations, not legacy apex's
        # convert_syncbn_model: apex.parallel.SyncBatchNorm has no way to count a placeholder
        # sample as none (it takes no empty batch), so uneven last batches would normalise
        # wrongly. Converting before amp.initialize keeps the order apex requires.
        return _torch_dist.convert_sync_batchnorm(model, self.device)

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.settings.fused_optimizer:  # before amp.initialize, which patches the optimizer
            optimizer = fused_twin(optimizer, importlib.import_module("apex.optimizers"))
        return self.generation.setup(model, optimizer)

    @property
    @override
    def sets_up_together(self) -> bool:
        # legacy amp: one amp.initialize for every model and optimizer (apex's rule)
        return isinstance(self.generation, LegacyApex)

    @override
    def setup_together(
        self, entries: Sequence[tuple[nn.Module, Sequence[torch.optim.Optimizer]]]
    ) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        generation = self.generation
        if not isinstance(generation, LegacyApex):
            return super().setup_together(entries)
        self.start()
        models: list[nn.Module] = []
        optimizers: list[list[torch.optim.Optimizer]] = []
        for model, opts in entries:
            place(model, self.device, self.name, self.placement_refusal, choices=self.choices)
            if self.options.sync_batchnorm:
                model = self.convert_sync_batchnorm(model)
            models.append(model)
            if self.settings.fused_optimizer:
                apex_optimizers = importlib.import_module("apex.optimizers")
                opts = [fused_twin(opt, apex_optimizers) for opt in opts]
            optimizers.append(list(opts))
        return generation.setup_together(models, optimizers)

    # ------------------------------------------------------------------ the generation's hooks
    @override
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return self.generation.autocast()

    @override
    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.generation.backward(loss, optimizer)

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool = False
    ) -> StepOutcome:
        return self.generation.optimizer_step(optimizer, skip_nonfinite=skip_nonfinite)

    @override
    def compile_model(
        self, model: nn.Module, compiler: Callable[[nn.Module], nn.Module]
    ) -> nn.Module:
        return self.generation.compile_model(model, compiler)

    @override
    def finalize_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.generation.finalize_gradients(optimizer)

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip: GradientClip) -> torch.Tensor:
        grads = self.generation.gradients(optimizer)
        return clip_(grads, clip, local_norm(grads, self.device))

    @override
    def scale_gradients(
        self, optimizer: torch.optim.Optimizer, factor: float | torch.Tensor
    ) -> None:
        scale_(self.generation.gradients(optimizer), factor)  # legacy amp: the master gradients

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.generation.no_sync(model)

    @override
    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.generation.unwrap(model)
