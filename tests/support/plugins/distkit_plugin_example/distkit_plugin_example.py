"""A distkit strategy from outside distkit: torch.distributed, gradients averaged by hand.

It keeps the Strategy contract: after ``backward`` outside ``no_sync`` every gradient is the
mean over ranks; inside ``no_sync`` nothing is communicated; ``unwrap`` is the identity (the
model is never wrapped). It runs under torchrun, the default launcher family.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import Strategy, Topology


class ExampleStrategy(Strategy):
    """Plain all-reduce of every gradient after backward, over gloo."""

    name = "example"

    def __init__(self) -> None:
        super().__init__()
        self._params: list[nn.Parameter] = []
        self._sync = True

    def _setup_environment(self) -> Topology:
        dist.init_process_group("gloo")  # the rendezvous torchrun announced (env://)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return Topology(dist.get_rank(), local_rank, dist.get_world_size(), torch.device("cpu"))

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        super().teardown()

    def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Any) -> tuple[Any, Any]:
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
        self._params = list(model.parameters())
        return model, optimizer

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        super().backward(loss, optimizer)
        for grad in (p.grad for p in self._params if self._sync and p.grad is not None):
            dist.all_reduce(grad)
            grad /= self.world_size

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        out = tensor.detach().clone()
        dist.all_reduce(out)
        return out / self.world_size if op == "mean" else out

    def _broadcast(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.detach().contiguous())
        return torch.stack(out)

    def _all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()
