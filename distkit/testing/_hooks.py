"""Promises about the trainer's hooks: clipping, validation cadence and stopping together.

Clipping must see the gradients one process would have (averaged over ranks, unscaled, once
per optimizer step on the accumulated gradient); a validation every k steps must count every
sample once; ``should_stop`` set on one rank must stop every rank after the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit.callbacks import Callback
from distkit.testing import _workload
from distkit.testing._processes import in_plain_process
from distkit.testing._promise import (
    Promise,
    close,
    expect,
    expect_norms_like_one_process,
    max_abs_diff,
)
from distkit.testing._target import StrategyUnderTest

#: the clipping threshold: below the workload's gradient norms, so most steps clip
CLIP_NORM = 0.5
#: micro-batches per optimizer step in the clipping promise
ACCUMULATE = 2
#: validate every this many optimizer steps (mid-epoch at any world size)
VAL_EVERY = 3
#: the step after which one rank asks to stop
STOP_AT = 3


class StepRecorder(Callback):
    """Keeps every step's ``logs`` (read, so device values become floats)."""

    stops_training = False

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    @override
    def on_train_step_end(self, trainer: Any, logs: Mapping[str, Any]) -> None:
        self.steps.append({key: logs[key] for key in ("step", "grad_norm", "skipped")})


def clipped_fit(target: StrategyUnderTest, batch_size: int) -> dict[str, Any]:
    """The workload with clipping, accumulation and a validation every VAL_EVERY steps."""
    recorder = StepRecorder()
    with target.trainer(
        batch_size=batch_size,
        max_epochs=2,
        seed=3,
        grad_accum_steps=ACCUMULATE,
        gradient_clip_norm=CLIP_NORM,
        val_every_n_steps=VAL_EVERY,
        callbacks=[recorder],
    ) as t:
        model = _workload.model(0, target.dtype)
        optimizer = _workload.optimizer(model)
        data = _workload.dataset(target.dtype)
        result = t.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy, val_data=data)
        return {
            "weights": _workload.trained_in(t.full_state_dict(), target.dtype),
            "norms": [s["grad_norm"] for s in recorder.steps],
            "validations": result.validations,
        }


def _reference_clipped(batch_size: int, dtype: torch.dtype) -> dict[str, Any]:
    return clipped_fit(StrategyUnderTest(_workload.reference_strategy(), dtype=dtype), batch_size)


@cache
def reference_clipped(world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """One plain CPU process at ``world_size * BATCH_SIZE`` in ``dtype``, same clipping."""
    return in_plain_process(_reference_clipped, world_size * _workload.BATCH_SIZE, dtype)


def _clipping_body(target: StrategyUnderTest, workdir: Path) -> Any:
    return clipped_fit(target, _workload.BATCH_SIZE)


def _verify_clipping(results: list[dict[str, Any]], world: int) -> None:
    tol = _workload.tolerance_of(results[0]["weights"])
    one = reference_clipped(world, _workload.dtype_of(results[0]["weights"]))
    expect_norms_like_one_process(
        results, one, clip=CLIP_NORM, tolerance=tol, what="logs['grad_norm']"
    )
    for rank, r in enumerate(results):
        diff = max_abs_diff(r["weights"], one["weights"])
        expect(
            diff <= tol,
            f"rank {rank}: with gradient_clip_norm={CLIP_NORM} and {ACCUMULATE} accumulated "
            f"micro-batches, {world} processes end {diff:.3g} away from one process at "
            f"{world}x the batch (allowed {tol:g})",
        )
        expect(
            close(r["validations"], one["validations"], tol),
            f"rank {rank}: validations every {VAL_EVERY} steps {r['validations']} differ from "
            f"one process's {one['validations']} (each must count every sample once)",
        )


# ---------------------------------------------------------------- stopping together
class _StopOnLastRank(Callback):
    """The last rank asks to stop after step STOP_AT: the others must hear of it."""

    @override
    def on_train_step_end(self, trainer: Any, logs: Mapping[str, Any]) -> None:
        if trainer.rank == trainer.world_size - 1 and logs["step"] == STOP_AT:
            trainer.should_stop = True


def _stop_body(target: StrategyUnderTest, workdir: Path) -> Any:
    options = {"batch_size": _workload.BATCH_SIZE, "max_epochs": 2, "seed": 3}
    with target.trainer(callbacks=[_StopOnLastRank()], **options) as t:
        model = _workload.model(0, target.dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = _workload.dataset(target.dtype)
        result = t.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
        return {
            "step": t.global_step,
            "stopped_early": result.stopped_early,
            "epochs": len(result.history),
        }


def _verify_stop(results: list[dict[str, Any]], world: int) -> None:
    for rank, r in enumerate(results):
        expect(
            r == {"step": STOP_AT, "stopped_early": True, "epochs": 0},
            f"rank {rank}: rank {world - 1} set should_stop after step {STOP_AT}; this rank "
            f"ended at step {r['step']} (stopped_early={r['stopped_early']}, "
            f"{r['epochs']} epochs recorded), not after step {STOP_AT} with no epoch recorded",
        )


# ---------------------------------------------------------------- callback state
def _patience_fit(target: StrategyUnderTest, folder: Path, max_epochs: int) -> dict[str, Any]:
    from distkit.callbacks import EarlyStopping

    # the training loss falls every epoch, so mode="max" sees no improvement after the first
    stopper = EarlyStopping(monitor="train_loss", mode="max", patience=3)
    options = {"batch_size": _workload.BATCH_SIZE, "max_epochs": max_epochs, "seed": 3}
    with target.trainer(checkpoint_dir=folder, resume="auto", callbacks=[stopper], **options) as t:
        model = _workload.model(0, target.dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = _workload.dataset(target.dtype)
        result = t.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
        return {
            "epochs": len(result.history),
            "stopped_early": result.stopped_early,
            "wait": stopper.wait,
        }


def _callback_state_body(target: StrategyUnderTest, workdir: Path) -> Any:
    folder = workdir / "callback_state"
    first = _patience_fit(target, folder, max_epochs=2)
    resumed = _patience_fit(target, folder, max_epochs=10)
    return {"first": first, "resumed": resumed}


def _verify_callback_state(results: list[dict[str, Any]], world: int) -> None:
    for rank, r in enumerate(results):
        expect(
            r["first"] == {"epochs": 2, "stopped_early": False, "wait": 1},
            f"rank {rank}: 2 epochs with EarlyStopping(patience=3) ended with {r['first']}",
        )
        expect(
            r["resumed"] == {"epochs": 4, "stopped_early": True, "wait": 3},
            f"rank {rank}: resumed from the epoch-2 checkpoint (patience counter 1), training "
            f"should stop after epoch 4 with the counter at 3; it ended with {r['resumed']} "
            "(a counter that starts afresh stops after epoch 6)",
        )


CLIPPING = Promise(
    "clipping",
    f"gradient_clip_norm with {ACCUMULATE} accumulated micro-batches: N processes at b clip "
    "and train like one at N * b (norms, weights, validations every "
    f"{VAL_EVERY} steps)",
    _clipping_body,
    _verify_clipping,
    min_world_size=2,
)
CALLBACK_STATE_ROUND_TRIP = Promise(
    "callback_state_round_trip",
    "a callback's state (EarlyStopping's patience counter) goes into checkpoints and a resumed "
    "run goes on from it",
    _callback_state_body,
    _verify_callback_state,
)
STOP_TOGETHER = Promise(
    "stop_together",
    f"should_stop set on one rank after step {STOP_AT} stops every rank after that step",
    _stop_body,
    _verify_stop,
)
