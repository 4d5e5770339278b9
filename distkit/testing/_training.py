"""Promises about the Trainer's fits: world-size invariance and the checkpoint round trip.

Two epochs of the workload (:mod:`distkit.testing._workload`) through ``Trainer.fit``; the
round trip goes through ``save_checkpoint`` / ``load_checkpoint`` (the strategy's
``state_io.checkpoint_state``: sharded checkpoints where the strategy writes them).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit.testing._processes import in_plain_process
from distkit.testing._promise import Promise, expect, max_abs_diff
from distkit.testing._target import StrategyUnderTest
from distkit.testing._workload import (
    BATCH_SIZE,
    TOLERANCE,
    dataset,
    dtype_of,
    model,
    optimizer,
    reference_strategy,
    tolerance_of,
    trained_in,
)

#: optimizer steps before the checkpoint of the round trip (mid-epoch at any world size)
STEPS_BEFORE_SAVE = 5


def fit(
    target: StrategyUnderTest,
    batch_size: int,
    *,
    max_steps: int | None = None,
    save_to: Path | None = None,
    resume_from: Path | None = None,
    model_seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Train the workload for two epochs (or ``max_steps``); the full final weights."""
    with target.trainer(batch_size=batch_size, max_epochs=2, max_steps=max_steps, seed=3) as t:
        net = model(model_seed, target.dtype)
        if resume_from is not None:
            t.load_checkpoint(resume_from)
        t.fit(net, optimizer(net), dataset(target.dtype), loss_fn=nn.functional.cross_entropy)
        if save_to is not None:
            t.save_checkpoint(save_to)
        return trained_in(t.full_state_dict(), target.dtype)


def _reference_fit(batch_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return fit(StrategyUnderTest(reference_strategy(), dtype=dtype), batch_size)


@cache
def reference_weights(world_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One plain CPU process at ``world_size * BATCH_SIZE`` in ``dtype`` (computed once per
    world size and dtype)."""
    return in_plain_process(_reference_fit, world_size * BATCH_SIZE, dtype)


# ---------------------------------------------------------------- world-size invariance
def _world_size_invariance_body(target: StrategyUnderTest, workdir: Path) -> Any:
    return fit(target, BATCH_SIZE)


def _verify_world_size_invariance(results: list[dict[str, torch.Tensor]], world: int) -> None:
    tolerance = tolerance_of(results[0])
    for rank, weights in enumerate(results):
        between = max_abs_diff(weights, results[0])
        expect(
            between <= tolerance,
            f"after training, rank {rank}'s weights differ from rank 0's by {between:.3g}",
        )
    one = reference_weights(world, dtype_of(results[0]))
    diff = max_abs_diff(results[0], one)
    expect(
        diff <= tolerance,
        f"{world} processes at batch size {BATCH_SIZE} end {diff:.3g} away from one process "
        f"({reference_strategy()!r}) at batch size {world * BATCH_SIZE} (allowed "
        f"{tolerance:g} in {dtype_of(results[0])})",
    )


# ---------------------------------------------------------------- checkpoint round trip
def _checkpoint_round_trip_body(target: StrategyUnderTest, workdir: Path) -> Any:
    path = workdir / "checkpoint_round_trip.pt"
    whole = fit(target, BATCH_SIZE)
    fit(target, BATCH_SIZE, max_steps=STEPS_BEFORE_SAVE, save_to=path)
    # other initial weights: the checkpoint, not the seed, must decide where training goes on
    resumed = fit(target, BATCH_SIZE, resume_from=path, model_seed=1)
    return {"whole": whole, "resumed": resumed}


def _verify_checkpoint_round_trip(results: list[dict[str, Any]], world: int) -> None:
    for rank, r in enumerate(results):
        diff = max_abs_diff(r["resumed"], r["whole"])
        tolerance = tolerance_of(r["whole"])
        expect(
            diff <= tolerance,
            f"rank {rank}: trained {STEPS_BEFORE_SAVE} steps, saved, resumed in a new Trainer "
            f"and finished: the weights end {diff:.3g} away from an uninterrupted run "
            f"(allowed {tolerance:g})",
        )


WORLD_SIZE_INVARIANCE = Promise(
    "world_size_invariance",
    f"N processes at batch size b train like one process at N * b (within {TOLERANCE:g} in "
    "float64)",
    _world_size_invariance_body,
    _verify_world_size_invariance,
    min_world_size=2,
)
CHECKPOINT_ROUND_TRIP = Promise(
    "checkpoint_round_trip",
    "train, save_checkpoint, resume in a new Trainer: as if uninterrupted (within "
    f"{TOLERANCE:g} in float64)",
    _checkpoint_round_trip_body,
    _verify_checkpoint_round_trip,
)
