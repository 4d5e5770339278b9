"""What "N processes train like one process" is compared in, and within what.

The promise is that N processes with batch ``b`` end with the parameters one process ends
with at ``N * b``. The two runs do the same arithmetic in another order: each rank sums its
share, the all-reduce sums the shares. In float32 that order alone moves a weight by ~1e-7
per step, and an optimizer such as Adam magnifies it; the size depends on the CPU (its
kernels' blocking and vector width), so a float32 tolerance chosen by watching a test pass
on one machine fails on another (issue 42: 4.25e-5 on one x86_64 CPU, 1.37e-5 on an AMD
EPYC, for the same GPT-2 run). So the exactness tests train in float64 (model and data),
where the same orders differ by ~1e-16 per step (measured on the shared workloads, 2026-12-03:
2 ranks against one process 1.2e-16 after 2 epochs of SGD on ddp; see
``distkit.testing._workload`` for every backend), while a real bug (a sample counted twice, a
wrong divisor, a missing all-reduce) moves the weights by 1e-3 or more.

Tests where float32 is the point (mixed precision, the fp16 loss scale, apex's master weights,
DeepSpeed, an example's own dtype) keep float32 and say beside their tolerance where it comes
from (a floor measured on the same comparison). Runs that do the same arithmetic in the same
order (a resume at the same world size, activation checkpointing against none, one process
against a hand loop) are compared bitwise, in any dtype: a tolerance there only hides a bug.
"""

from __future__ import annotations

from typing import Any

import torch

#: the dtype the exactness tests train their model and data in
DTYPE = torch.float64
#: float64: a million times the summation-order floor, a million times below a real bug
TOL = 1e-9


def assert_same_epochs(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Two fits' histories: the same epochs, each's training and validation loss within TOL."""
    for a, b in zip(mine, theirs, strict=True):
        for key in ("train_loss", "val_loss"):
            assert abs(a[key] - b[key]) <= TOL, (key, a[key], b[key])
