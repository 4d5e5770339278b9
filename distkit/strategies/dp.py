"""Single-process ``torch.nn.DataParallel`` (on CPU or one GPU: the plain module)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit.errors import ConfigurationError, LauncherMismatchError, UnsupportedFeatureError
from distkit.launch import native_alternative
from distkit.launch._env import LaunchEnv
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.launch.families import SINGLE_PROCESS
from distkit.strategies.base import Strategy, Topology


class DataParallelStrategy(Strategy):
    """One process drives every visible GPU with ``nn.DataParallel``.

    With no GPU, or one, the module runs as it is, so this is also the serial strategy: its
    collectives are those of a world of one.

    Args:
        device_ids: GPUs to use (default: all visible ones).
    """

    name = "dp"
    comm_phase = "none"  # gradients are gathered inside backward on the first GPU
    placement_refusal = (
        "nn.DataParallel copies the whole model from its first GPU onto every GPU in "
        "device_ids each step, so the model must sit whole on the first one"
    )
    launcher = SINGLE_PROCESS
    auto_select = True

    @override
    @classmethod
    def diagnose(cls, machine: MachineFacts) -> StrategyReport:
        n = machine.cuda_devices
        if n > 1:
            return StrategyReport(
                cls.name, True, f"{n} replicas (nn.DataParallel over GPUs 0..{n - 1})"
            )
        where = "one GPU" if n == 1 else "no GPU"
        return StrategyReport(
            cls.name, True, f"1 replica ({where}: DataParallel just runs the module)"
        )

    def __init__(self, *, device_ids: list[int] | None = None) -> None:
        super().__init__()
        self._requested_ids = None if device_ids is None else list(device_ids)
        self.device_ids: list[int] = []

    @override
    def _setup_environment(self) -> Topology:
        env = LaunchEnv.detect()
        if env.is_multiprocess_launcher and env.world_size > 1:
            raise LauncherMismatchError(
                f"strategy='dp' (nn.DataParallel) runs in a single process, but {env.launcher} "
                f"started {env.world_size} processes (this is rank {env.rank}). Use "
                f"strategy={self.choices.auto_name(env)!r} under {env.launcher}, or run this "
                "script with plain `python` for DataParallel."
            )
        self.device_ids = self._resolve_device_ids()
        device = (
            torch.device("cuda", self.device_ids[0]) if self.device_ids else torch.device("cpu")
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return Topology(rank=0, local_rank=0, world_size=1, device=device)

    def _resolve_device_ids(self) -> list[int]:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self._requested_ids is None:
            return list(range(available))
        bad = [i for i in self._requested_ids if not 0 <= i < available]
        if bad or not self._requested_ids:
            raise ConfigurationError(
                f"device_ids={self._requested_ids} is not a non-empty list of visible GPUs; this "
                f"machine has {available} (allowed ids: 0..{available - 1}). Pass device_ids=None "
                "to use all of them."
            )
        return self._requested_ids

    @property
    def replicas(self) -> int:
        """How many devices a forward pass is split over (1 on CPU or one GPU)."""
        return max(1, len(self.device_ids))

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.replicas == 1:
            return model, optimizer
        return nn.DataParallel(model, device_ids=self.device_ids), optimizer

    @override
    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        if self.replicas == 1:
            return model  # one replica sees the whole batch: BatchNorm is already global
        instead = native_alternative(self.choices)
        raise UnsupportedFeatureError(
            f"nn.DataParallel cannot synchronise BatchNorm across its {self.replicas} replicas "
            f"(each replica normalises its own slice of the batch). Use strategy={instead!r} "
            "with sync_batchnorm=True (one process per GPU, launched with torchrun)."
        )

    @override
    def reduce_loss(self, loss: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Average a loss that DataParallel gathered as one value per replica."""
        if loss.ndim == 0:
            return loss
        return replica_loss_mean(loss, batch_size, self.replicas)

    @override
    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model

    @override
    def eval_model(self, model: nn.Module) -> nn.Module:
        return model  # no collectives inside DataParallel: keep the multi-GPU split for eval

    @override
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor.detach().clone()

    @override
    def _broadcast(self, obj: Any, src: int) -> Any:
        return obj

    @override
    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone().unsqueeze(0)

    @override
    def _all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    @override
    def barrier(self) -> None:
        """Nothing to wait for in a single process."""


def replica_loss_mean(loss: torch.Tensor, batch_size: int, replicas: int) -> torch.Tensor:
    """The batch-mean loss from DataParallel's per-replica means.

    DataParallel splits a batch of ``batch_size`` with ``Tensor.chunk(replicas)``, so the last
    replicas can hold fewer samples (or none); weighting by chunk size gives the exact batch mean.
    """
    sizes = [len(chunk) for chunk in torch.arange(batch_size).chunk(replicas)]
    if loss.ndim != 1 or loss.numel() != len(sizes):
        raise ConfigurationError(
            f"the loss has shape {tuple(loss.shape)}; expected a scalar or one value per "
            f"DataParallel replica ({len(sizes)} for a batch of {batch_size}). Return the "
            "batch-mean loss from loss_fn / step_fn."
        )
    weights = torch.tensor(sizes, dtype=loss.dtype, device=loss.device)
    return (loss * weights).sum() / batch_size
