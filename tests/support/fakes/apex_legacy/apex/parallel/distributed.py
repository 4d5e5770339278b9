"""FAKE ``apex.parallel.DistributedDataParallel`` (legacy apex <= 25.04), CPU/gloo, for tests.

What is mirrored from real apex (NVIDIA/apex ``apex/parallel/distributed.py``):

* the constructor signature and its checks: no default process group -> the ``ValueError``
  torch raises from ``dist.get_backend()``; ``shared_param`` -> ``ValueError``;
  ``num_allreduce_streams > 1`` with ``delay_allreduce`` -> ``ValueError``;
  ``allreduce_trigger_params`` with ``delay_allreduce`` -> ``ValueError``; a
  ``DeprecatedFeatureWarning`` on rank 0 (apex >= 22.12 warns that apex DDP is deprecated);
* at construction, every *parameter* (not the buffers: real apex never syncs buffers, so BN
  running statistics stay per rank) is broadcast from rank 0;
* hooks on each parameter's gradient accumulation queue one callback per backward pass with
  ``Variable._execution_engine.queue_callback``; the callback all-reduces every existing
  ``.grad`` (flattened per dtype) and divides by the world size (``gradient_average``;
  ``gradient_predivide_factor`` splits the division around the all-reduce, as real apex);
* ``disable_allreduce()`` / ``enable_allreduce()`` (checked when the hooks fire, so grads
  accumulated while disabled are reduced, in full, by the next enabled backward); no
  ``no_sync()`` (real apex DDP has none); ``.module`` holds the wrapped model, so state-dict keys
  gain a ``module.`` prefix.

Differences: real apex requires CUDA (``torch.cuda.current_stream()`` in the constructor) and
overlaps bucketed all-reduces with the backward pass; the fake always reduces once, at the end
of the backward pass, on CPU (gloo). The per-backward flag is cleared by ``forward`` (as in real
apex) and also after each reduction. Records ``"parallel.DistributedDataParallel"``,
``"ddp.broadcast"``, ``"ddp.allreduce"``, ``"ddp.disable_allreduce"``, ``"ddp.enable_allreduce"``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.modules import Module

from apex._common.deprecation import deprecated_warning
from apex._common.recorder import record


def _split_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: OrderedDict[torch.dtype, list[torch.Tensor]] = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return list(buckets.values())


def _broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    for bucket in _split_by_dtype(tensors):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.broadcast(flat, 0)
        synced_tensors = torch._utils._unflatten_dense_tensors(flat, bucket)
        for tensor, synced in zip(bucket, synced_tensors, strict=True):
            tensor.copy_(synced)


class DistributedDataParallel(Module):
    """Fake of ``apex.parallel.DistributedDataParallel`` that really averages grads over ranks."""

    def __init__(
        self,
        module: Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
    ) -> None:
        super().__init__()
        deprecated_warning(
            "apex.parallel.DistributedDataParallel is deprecated and will be removed by the end "
            "of February 2023."
        )
        self._backend = dist.get_backend()  # ValueError without a default process group

        self.prof = prof
        self.allreduce_different_streams = num_allreduce_streams > 1
        self.num_allreduce_streams = num_allreduce_streams
        self.allreduce_communicators = allreduce_communicators
        if self.allreduce_different_streams and delay_allreduce:
            raise ValueError(
                "self.allreduce_different_streams may only be used if delay_allreduce=False."
            )
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported as an option.  It was misleadingly named "
                "from the start.  It turns out overlapping communication with computation should "
                "work fine with shared parameters.  If you still wish to delay communication to "
                "the end of the backward pass, use delay_allreduce=True|False instead."
            )
        if gradient_average_split_factor is not None:
            print(
                "Warning:  gradient_average_split_factor has been renamed to "
                "gradient_predivide_factor.  For now, gradient_average_split_factor will "
                "override gradient_predivide_factor."
            )
            gradient_predivide_factor = gradient_average_split_factor
        self.world_size = float(dist.get_world_size())
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.custom_allreduce_triggers = False
        if allreduce_trigger_params is not None:
            if delay_allreduce:
                raise ValueError(
                    "Setting allreduce_trigger_params is only valid if delay_allreduce=False."
                )
            self.custom_allreduce_triggers = True
            self.allreduce_trigger_params = {id(p) for p in allreduce_trigger_params}
        self.delay_allreduce = delay_allreduce
        self.message_size = message_size

        self.module = module
        self._disable_allreduce = False
        self.callback_queued = False
        if self._backend == dist.Backend.NCCL:
            for param in self.module.parameters():
                assert param.is_cuda, "NCCL backend only supports model parameters to be on GPU."

        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._grad_ready)
            for param in self.module.parameters()
            if param.requires_grad
        ]
        params = [param.data for param in self.module.parameters()]
        record(
            "parallel.DistributedDataParallel",
            message_size=message_size,
            delay_allreduce=delay_allreduce,
            gradient_average=gradient_average,
            gradient_predivide_factor=gradient_predivide_factor,
            allreduce_always_fp32=allreduce_always_fp32,
            world_size=int(self.world_size),
            backend=str(self._backend),
        )
        with torch.no_grad():
            _broadcast_from_rank0(params)
        record("ddp.broadcast", num_tensors=len(params))

    def enable_allreduce(self) -> None:
        record("ddp.enable_allreduce")
        self._disable_allreduce = False

    def disable_allreduce(self) -> None:
        record("ddp.disable_allreduce")
        self._disable_allreduce = True

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._disable_allreduce or self.callback_queued:
            return
        Variable._execution_engine.queue_callback(self._allreduce_params)
        self.callback_queued = True

    @torch.no_grad()
    def _allreduce_params(self) -> None:
        self.callback_queued = False
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        numel = 0
        for bucket in _split_by_dtype(grads):
            flat = torch._utils._flatten_dense_tensors(bucket)
            work = flat.float() if self.allreduce_always_fp32 else flat
            if self.gradient_predivide_factor != 1.0:
                work.mul_(1.0 / self.gradient_predivide_factor)
            dist.all_reduce(work)
            if self.gradient_average:
                work.mul_(self.gradient_predivide_factor / self.world_size)
            synced_grads = torch._utils._unflatten_dense_tensors(work, bucket)
            for grad, synced in zip(bucket, synced_grads, strict=True):
                grad.copy_(synced)
            numel += flat.numel()
        record(
            "ddp.allreduce",
            num_tensors=len(grads),
            numel=numel,
            world_size=int(self.world_size),
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        result = self.module(*inputs, **kwargs)
        if not self._disable_allreduce:
            self.callback_queued = False
        return result
