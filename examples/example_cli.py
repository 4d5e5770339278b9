"""What the examples share at the command line: thread limits and one-line errors."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

import torch

import distkit


def launched_rank() -> int:
    """This process's rank as the launcher announced it (0 without a launcher)."""
    for key in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def limit_threads() -> None:
    """One intra-op thread per process when several share a machine and nobody chose.

    torch starts one thread per core in every process, so 2 processes x 2 threads on 2 cores
    fight over the cores and run slower than 1 thread each. torchrun sets OMP_NUM_THREADS=1;
    horovodrun and mpirun do not. An OMP_NUM_THREADS the user set is respected.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    # torchrun, horovodrun, Open MPI's mpirun, MPICH's mpiexec
    names = ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    sizes = tuple(os.environ.get(name, "") for name in names)
    if any(size.isdigit() and int(size) > 1 for size in sizes):
        torch.set_num_threads(1)


def cosine(total_steps: int) -> Callable[[int], float]:
    """The LR factor at optimizer step ``s``: from 1 down to 0 at ``total_steps``, a half cosine."""

    def factor(step: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))

    return factor  # a plain function: LambdaLR checkpoints only its step count, not the total


def diverged(train_loss: float, lr: float, *, is_main: bool) -> bool:
    """Whether the final loss is not finite; rank 0 says so (the history is the same on all)."""
    if math.isfinite(train_loss):
        return False
    if is_main:
        print(
            f"error: training diverged: final train loss is {train_loss}; "
            f"try a lower --lr (now {lr}) or --precision 32",
            file=sys.stderr,
        )
    return True


def run(main: Callable[[], int]) -> int:
    """Run ``main``; a distkit error becomes one line from rank 0 and exit status 2."""
    try:
        return main()
    except distkit.DistkitError as exc:
        if launched_rank() == 0:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2


def agree_on_failure(trainer: distkit.Trainer, failure: BaseException | None) -> tuple[bool, bool]:
    """One decision for all ranks after each prepared its data (a rank that went on to train
    alone would wait for the others): ``(rank 0 failed, any rank failed)``."""
    flags = torch.tensor(
        [float(failure is not None and trainer.is_main), float(failure is not None)]
    )
    main_failed, any_failed = trainer.strategy.all_reduce(flags, op="sum").tolist()
    return bool(main_failed), bool(any_failed)
