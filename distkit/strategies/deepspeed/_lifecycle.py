"""What a DeepSpeed engine's life needs from the process around it: no inference op compiled
at its start, ``LOCAL_RANK`` set while it runs, and no clones of a destroyed world's groups
left behind at its end."""

from __future__ import annotations

import contextlib
import os
import sys

#: strategies relying on the LOCAL_RANK distkit set (None: the launcher set it, not distkit)
_local_rank_holders: int | None = None


def hold_local_rank(local_rank: int) -> None:
    """Set ``LOCAL_RANK`` where the launcher did not (plain ``python``, a world of one):
    DeepSpeed reads it at its set-up and, at stage 3, in each forward. Several strategies
    may hold it at once (a sweep makes the next Trainer before the last is dropped); the
    last :func:`release_local_rank` removes it, as it was."""
    global _local_rank_holders
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local_rank)
        _local_rank_holders = 1
    elif _local_rank_holders is not None:
        _local_rank_holders += 1


def release_local_rank() -> None:
    """One holder of :func:`hold_local_rank` done; the last removes the LOCAL_RANK distkit
    set (one the launcher set stays)."""
    global _local_rank_holders
    if _local_rank_holders is None:
        return
    _local_rank_holders -= 1
    if _local_rank_holders <= 0:
        os.environ.pop("LOCAL_RANK", None)
        _local_rank_holders = None


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
