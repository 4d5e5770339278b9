"""Promises about a user's own loop on the Runtime: N processes train like one.

Each body runs the loop of :mod:`distkit.testing._user_loop` on every rank; each verifier
holds every rank's final weights (and optimizer steps, and gradient norms before clipping)
against one plain CPU process that takes each optimizer step's samples in one batch. The
61 samples leave every epoch a short last batch, split unevenly over two ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distkit.testing._promise import (
    Promise,
    expect,
    expect_norms_like_one_process,
    max_abs_diff,
)
from distkit.testing._target import StrategyUnderTest
from distkit.testing._user_loop import Loop, reference, train
from distkit.testing._workload import TOLERANCE, dtype_of, reference_strategy, tolerance_of

PLAIN = Loop()
#: two micro-batches per step: the last window of an epoch is short (13 samples at 2 ranks)
ACCUMULATING = Loop(grad_accum_steps=2)
#: below the workload's gradient norms, so most steps clip
CLIP_NORM = 0.5
CLIPPING = Loop(grad_accum_steps=2, clip_norm=CLIP_NORM)


def expect_like_one_process(results: list[dict[str, Any]], world: int, loop: Loop) -> None:
    """Every rank ends where one process taking each step's samples in one batch ends."""
    one_loop = loop.in_one_process(world)
    dtype, tolerance = dtype_of(results[0]["weights"]), tolerance_of(results[0]["weights"])
    one = reference(loop, world, dtype)
    for rank, r in enumerate(results):
        expect(
            r["steps"] == one["steps"],
            f"rank {rank}: {r['steps']} optimizer steps in {loop.epochs} epochs; one process "
            f"at {one_loop.describe()} takes {one['steps']}",
        )
        diff = max_abs_diff(r["weights"], one["weights"])
        expect(
            diff <= tolerance,
            f"rank {rank}: a user loop at {world} process(es) with {loop.describe()} ends "
            f"{diff:.3g} away from one process ({reference_strategy()!r}) at "
            f"{one_loop.describe()} (allowed {tolerance:g} in {dtype})",
        )


def _plain_body(target: StrategyUnderTest, workdir: Path) -> Any:
    return train(target, PLAIN)


def _verify_plain(results: list[dict[str, Any]], world: int) -> None:
    expect_like_one_process(results, world, PLAIN)


def _accumulating_body(target: StrategyUnderTest, workdir: Path) -> Any:
    return train(target, ACCUMULATING)


def _verify_accumulating(results: list[dict[str, Any]], world: int) -> None:
    expect_like_one_process(results, world, ACCUMULATING)


def _clipping_body(target: StrategyUnderTest, workdir: Path) -> Any:
    return train(target, CLIPPING)


def _verify_clipping(results: list[dict[str, Any]], world: int) -> None:
    weights = results[0]["weights"]
    one = reference(CLIPPING, world, dtype_of(weights))
    expect_norms_like_one_process(
        results, one, clip=CLIP_NORM, tolerance=tolerance_of(weights),
        what="optimizer.last_grad_norm",
    )  # fmt: skip
    expect_like_one_process(results, world, CLIPPING)


RUNTIME_WORLD_SIZE_INVARIANCE = Promise(
    "runtime_world_size_invariance",
    "a user loop on distkit.Runtime at N processes with batch b trains like one process at "
    f"N * b (within {TOLERANCE:g} in float64)",
    _plain_body,
    _verify_plain,
    min_world_size=2,
)
RUNTIME_ACCUMULATION = Promise(
    "runtime_accumulation",
    "a user loop with grad_accum_steps=2 (a short last window) trains like one process "
    f"taking each window's samples in one batch (within {TOLERANCE:g} in float64)",
    _accumulating_body,
    _verify_accumulating,
)
RUNTIME_CLIPPING = Promise(
    "runtime_clipping",
    f"rt.clip_gradients(max_norm={CLIP_NORM}) with 2 accumulated micro-batches sees and clips "
    "the gradients one process sees (norms and weights)",
    _clipping_body,
    _verify_clipping,
)
