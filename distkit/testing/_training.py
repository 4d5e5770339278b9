"""Promises about whole fits: world-size invariance and the checkpoint round trip.

The workload is small and deterministic: 61 samples (so the last global batch is short and
splits unevenly over two ranks), an MLP, SGD with momentum (optimizer state that a checkpoint
must carry), two epochs.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from distkit.launch._env import LaunchEnv, Launcher
from distkit.testing._processes import plain_env, run_on_ranks
from distkit.testing._promise import Promise, expect, max_abs_diff
from distkit.testing._target import StrategyUnderTest

#: the largest parameter difference the training promises allow
TOLERANCE = 1e-5
#: samples per process per step
BATCH_SIZE = 4
#: optimizer steps before the checkpoint of the round trip (mid-epoch at any world size)
STEPS_BEFORE_SAVE = 5
#: the launcher of the reference run, "one process at N * batch size": plain python, whose
#: strategy "auto" picks from the registry
REFERENCE_LAUNCHER: Launcher = "none"


def _reference_strategy() -> str:
    from distkit.registry import auto_strategy_name

    return auto_strategy_name(LaunchEnv(launcher=REFERENCE_LAUNCHER))


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(61, 6, generator=generator)
    y = (x[:, :3].argmax(dim=1) + (x[:, -1] > 1).long()) % 3
    return TensorDataset(x, y)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


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
        model = _model(model_seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if resume_from is not None:
            t.load_checkpoint(resume_from)
        t.fit(model, optimizer, _dataset(), loss_fn=nn.functional.cross_entropy)
        if save_to is not None:
            t.save_checkpoint(save_to)
        return t.full_state_dict()


def _reference_fit(batch_size: int) -> dict[str, torch.Tensor]:
    return fit(StrategyUnderTest(_reference_strategy()), batch_size)


@cache
def reference_weights(world_size: int) -> dict[str, torch.Tensor]:
    """One plain CPU process at ``world_size * BATCH_SIZE`` (computed once per world size)."""
    results = run_on_ranks(
        _reference_fit,
        world_size * BATCH_SIZE,
        world_size=1,
        launcher_env=plain_env,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    return dict(results[0])


# ---------------------------------------------------------------- world-size invariance
def _world_size_invariance_body(target: StrategyUnderTest, workdir: Path) -> Any:
    return fit(target, BATCH_SIZE)


def _verify_world_size_invariance(results: list[dict[str, torch.Tensor]], world: int) -> None:
    for rank, weights in enumerate(results):
        between = max_abs_diff(weights, results[0])
        expect(
            between <= TOLERANCE,
            f"after training, rank {rank}'s weights differ from rank 0's by {between:.3g}",
        )
    one = reference_weights(world)
    diff = max_abs_diff(results[0], one)
    expect(
        diff <= TOLERANCE,
        f"{world} processes at batch size {BATCH_SIZE} end {diff:.3g} away from one process "
        f"({_reference_strategy()!r}) at batch size {world * BATCH_SIZE} (allowed {TOLERANCE:g})",
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
        expect(
            diff <= TOLERANCE,
            f"rank {rank}: trained {STEPS_BEFORE_SAVE} steps, saved, resumed in a new Trainer "
            f"and finished: the weights end {diff:.3g} away from an uninterrupted run "
            f"(allowed {TOLERANCE:g})",
        )


WORLD_SIZE_INVARIANCE = Promise(
    "world_size_invariance",
    f"N processes at batch size b train like one process at N * b (within {TOLERANCE:g})",
    _world_size_invariance_body,
    _verify_world_size_invariance,
    min_world_size=2,
)
CHECKPOINT_ROUND_TRIP = Promise(
    "checkpoint_round_trip",
    f"train, save_checkpoint, resume in a new Trainer: as if uninterrupted (within {TOLERANCE:g})",
    _checkpoint_round_trip_body,
    _verify_checkpoint_round_trip,
)
