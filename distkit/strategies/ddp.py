"""Native ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distkit._env import LaunchEnv
from distkit.errors import ConfigurationError
from distkit.strategies import _torch_dist
from distkit.strategies.base import Strategy, Topology
from distkit.syncbn import convert_to_global_batchnorm

DEFAULT_TIMEOUT = timedelta(minutes=30)


class DDPStrategy(Strategy):
    """One process per device, gradients averaged by DDP during ``backward``.

    Runs unchanged under ``torchrun``, ``python -m torch.distributed.launch`` and plain ``python``
    (a world of one).

    Args:
        backend: torch.distributed backend; ``None`` picks nccl on CUDA and gloo on CPU.
        timeout: how long a collective may wait for the other ranks (seconds or timedelta).
        **ddp_kwargs: passed to ``DistributedDataParallel`` as they are (``static_graph``,
            ``bucket_cap_mb``, ``gradient_as_bucket_view``, ...); ``device_ids`` and
            ``find_unused_parameters`` are set by distkit.
    """

    name = "ddp"

    def __init__(
        self,
        *,
        backend: str | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        if self.timeout.total_seconds() <= 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        reserved = {"device_ids", "find_unused_parameters", "module"} & set(ddp_kwargs)
        if reserved:
            raise ConfigurationError(
                f"DDPStrategy sets {', '.join(sorted(reserved))} itself; pass "
                "find_unused_parameters to distkit.Trainer and let distkit choose device_ids"
            )
        self._ddp_kwargs = ddp_kwargs
        self._owns_group = False

    def _setup_environment(self) -> Topology:
        topology, self._owns_group = _torch_dist.init_process_group(
            LaunchEnv.detect(), backend=self.backend, timeout=self.timeout, strategy=self.name
        )
        return topology

    def teardown(self) -> None:
        if self._owns_group:
            _torch_dist.destroy_process_group()
            self._owns_group = False
        super().teardown()

    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.world_size == 1:
            return model, optimizer  # nothing to synchronise; DDP's reducer would be pure cost
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model,
            device_ids=device_ids,
            find_unused_parameters=self.options.find_unused_parameters,
            **self._ddp_kwargs,
        )
        return wrapped, optimizer

    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        if self.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # torch's SyncBatchNorm refuses CPU tensors; this one all-reduces through gloo
        return convert_to_global_batchnorm(model, _torch_dist.differentiable_all_reduce_sum)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return _torch_dist.all_reduce(tensor, op, self.world_size, self.device)

    def _broadcast(self, obj: Any, src: int) -> Any:
        return _torch_dist.broadcast_object(obj, src, self.rank)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _torch_dist.all_gather(tensor, self.world_size, self.device)

    def _all_gather_object(self, obj: Any) -> list[Any]:
        return _torch_dist.all_gather_object(obj, self.world_size)

    def barrier(self) -> None:
        torch.distributed.barrier()
