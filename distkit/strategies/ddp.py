"""Native ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from distkit.errors import ConfigurationError
from distkit.launch.families import TORCH_LAUNCHERS
from distkit.strategies import _torch_dist, _torch_group
from distkit.strategies.base import Strategy, Topology

#: DDPStrategy's gradient compressions (torch's default DDP communication hooks)
COMM_HOOKS = (None, "fp16", "bf16")


class DDPStrategy(_torch_dist.TorchDistributedCollectives, Strategy):
    """One process per device, gradients averaged by DDP during ``backward``.

    Runs unchanged under ``torchrun``, ``python -m torch.distributed.launch`` and plain ``python``
    (a world of one).

    Args:
        backend: torch.distributed backend; ``None`` picks nccl on CUDA and gloo on CPU.
        timeout: how long a collective may wait for the other ranks (seconds or timedelta);
            ``None``: the Trainer's ``collective_timeout``, else 30 minutes.
        comm_hook: compress the gradients DDP all-reduces: ``"fp16"`` (torch's
            ``fp16_compress_hook``: half the bytes, any backend) or ``"bf16"``
            (``bf16_compress_hook``: NCCL on CUDA only); ``None`` (default): full precision.
            The averaged gradients are rounded to that precision, so results differ from
            uncompressed training by about its rounding.
        **ddp_kwargs: passed to ``DistributedDataParallel`` as they are (``static_graph``,
            ``bucket_cap_mb``, ``gradient_as_bucket_view``, ...); ``device_ids`` and
            ``find_unused_parameters`` are set by distkit.
    """

    name = "ddp"
    launcher = TORCH_LAUNCHERS
    auto_select = True
    placement_refusal = None  # wrapped without device_ids, as torch documents for such models

    def __init__(
        self,
        *,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        comm_hook: str | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.timeout = _torch_group.as_timeout(timeout)
        if comm_hook not in COMM_HOOKS:
            raise ConfigurationError(
                f"DDPStrategy(comm_hook={comm_hook!r}); allowed: "
                + ", ".join(repr(h) for h in COMM_HOOKS)
                + " (None: uncompressed gradients)"
            )
        self.comm_hook = comm_hook
        reserved = {"device_ids", "find_unused_parameters", "module"} & set(ddp_kwargs)
        if reserved:
            raise ConfigurationError(
                f"DDPStrategy sets {', '.join(sorted(reserved))} itself; pass "
                "find_unused_parameters to distkit.Trainer or distkit.Runtime and let distkit "
                "choose device_ids"
            )
        self._ddp_kwargs = ddp_kwargs

    @override
    def _setup_environment(self) -> Topology:
        return self._join_group()

    @override
    def teardown(self) -> None:
        self._leave_group()
        super().teardown()

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.world_size == 1:
            return model, optimizer  # nothing to synchronise; DDP's reducer would be pure cost
        wrapped = _torch_dist.wrap_ddp(
            model,
            self.device,
            find_unused_parameters=self.options.find_unused_parameters,
            **self._ddp_kwargs,
        )
        if self.comm_hook is not None:
            self._register_comm_hook(wrapped)
        return wrapped, optimizer

    def _register_comm_hook(self, wrapped: nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        assert isinstance(wrapped, DistributedDataParallel)

        if self.comm_hook == "bf16" and self.device.type != "cuda":
            raise ConfigurationError(
                f"DDPStrategy(comm_hook='bf16') needs NCCL on CUDA (torch's bf16_compress_hook), "
                f"and this run trains on {self.device}; use comm_hook='fp16' (any backend) or "
                "no compression"
            )
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[
            str(self.comm_hook)
        ]
        wrapped.register_comm_hook(None, hook)

    @override
    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        return _torch_dist.convert_sync_batchnorm(model, self.device)

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    @override
    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model
