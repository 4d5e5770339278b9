"""How long one all-reduce of the model's gradients takes: a short probe once per epoch.

The phase timings cannot separate DDP's all-reduce from the backward it overlaps with (nor
Horovod's from the optimizer step that waits for it), so at the end of an epoch every rank
all-reduces a buffer of the gradients' size and times it. The buffer is separate: the model,
its gradients and the optimizer are never touched, so training is the same with or without
the probe. One optimizer step of DDP or Horovod all-reduces the gradients once, so the probe's
time is the communication per step; FSDP reduce-scatters the gradients and all-gathers the
parameters (twice when it reshards after forward), about 1 to 1.5 all-reduces of the same
size (a ring all-reduce is one reduce-scatter plus one all-gather).
"""

from __future__ import annotations

import statistics
import time
from typing import Protocol

import torch
from torch import nn

#: the largest buffer the probe allocates; a larger model's time is scaled up linearly
CAP_BYTES = 32 * 2**20
#: timed all-reduces after one warm-up (the median is kept: 5 rather than 3, since on shared
#: cores one descheduled rank delays every rank's all-reduce)
REPEATS = 5


class _AllReduce(Protocol):
    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor: ...


def gradient_size(model: nn.Module) -> tuple[int, torch.dtype]:
    """Elements and dtype of the gradients one step all-reduces (the trainable parameters).

    A sharded parameter (FSDP's DTensor) counts its full size, which is what one all-reduce
    would move.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0, torch.float32
    return sum(p.numel() for p in params), params[0].dtype


def allreduce_ms(strategy: _AllReduce, numel: int, dtype: torch.dtype) -> float:
    """Milliseconds one all-reduce of ``numel`` elements of ``dtype`` takes; 0.0 in a world
    of one.

    A collective: call it on every rank at the same point. Its cost is ``REPEATS + 1``
    all-reduces of at most :data:`CAP_BYTES` (one step's communication, 6 times); on CUDA
    it synchronises the device around each (once per epoch, never inside a step).
    """
    if strategy.world_size == 1 or numel == 0:
        return 0.0
    itemsize = dtype.itemsize
    probed = min(numel, max(CAP_BYTES // itemsize, 1))
    buffer = torch.zeros(probed, dtype=dtype, device=strategy.device)
    cuda = buffer.is_cuda
    times = []
    for _ in range(REPEATS + 1):  # the first one warms up (and lines the ranks up)
        if cuda:
            torch.cuda.synchronize(buffer.device)
        started = time.perf_counter()
        strategy.all_reduce(buffer, op="sum")
        if cuda:
            torch.cuda.synchronize(buffer.device)
        times.append(time.perf_counter() - started)
    del buffer
    return statistics.median(times[1:]) * 1000.0 * numel / probed
