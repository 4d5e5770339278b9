"""What a DeepSpeed engine's life needs from the process around it: no inference op compiled
at its start, and no clones of a destroyed world's groups left behind at its end."""

from __future__ import annotations

import contextlib
import sys


def forget_groups() -> None:
    """Drop DeepSpeed's module-level references to the process groups it cloned from the
    world distkit is about to destroy: a later strategy in this process (a second Trainer)
    joins a new world, and DeepSpeed would reach for the dead groups."""
    groups = sys.modules.get("deepspeed.utils.groups")
    release = getattr(groups, "_release_process_group_references", None)
    if callable(release):
        release(group=None)


def skip_inference_op_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (``deepspeed_shm_comm``,
    for inference) at the first ``initialize``: 90-130 s of g++ on two cores, and an error
    without a compiler. Training never uses it: mark it incompatible so it is not built."""
    import deepspeed.ops

    with contextlib.suppress(Exception):  # a DeepSpeed without the table builds it as before
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
