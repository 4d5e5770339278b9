"""A promise about a user loop's checkpoint: ``rt.save`` mid-epoch, ``rt.load``, finish.

The loop accumulates 2 micro-batches per step with SGD's momentum (state the file must
carry). Every rank trains uninterrupted; then trains ``SAVE_AFTER`` steps, saves and stops;
then a new Runtime with other initial weights loads the file and finishes. The file also
goes back to the calling process, where one plain process of the reference strategy loads
it (another world size, another backend) and finishes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from distkit.testing._promise import Promise, expect, max_abs_diff
from distkit.testing._target import StrategyUnderTest
from distkit.testing._user_loop import Loop, in_one_process, train
from distkit.testing._workload import TOLERANCE, dtype_of, reference_strategy, tolerance_of

LOOP = Loop(grad_accum_steps=2)
#: optimizer steps before the save: mid-epoch at 1 to 3 processes (8 samples per process each)
SAVE_AFTER = 2


def _body(target: StrategyUnderTest, workdir: Path) -> Any:
    path = workdir / "runtime_checkpoint_round_trip.pt"
    whole = train(target, LOOP)
    train(target, LOOP, save_after=SAVE_AFTER, save_to=path)
    # other initial weights: the file, not the seed, must decide where training goes on
    resumed = train(target, LOOP, resume_from=path, model_seed=1)
    # every rank sends the file (a few KB): the workdir is gone when the verifier runs
    return {"whole": whole, "resumed": resumed, "file": path.read_bytes()}


def _verify(results: list[dict[str, Any]], world: int) -> None:
    dtype = dtype_of(results[0]["whole"]["weights"])
    tolerance = tolerance_of(results[0]["whole"]["weights"])
    for rank, r in enumerate(results):
        whole, resumed = r["whole"], r["resumed"]
        expect(
            resumed["steps"] == whole["steps"] - SAVE_AFTER,
            f"rank {rank}: resumed after {SAVE_AFTER} of {whole['steps']} optimizer steps, "
            f"the loop took {resumed['steps']} more (the loader must continue with the batch "
            "after the saved one)",
        )
        diff = max_abs_diff(resumed["weights"], whole["weights"])
        expect(
            diff <= tolerance,
            f"rank {rank}: a user loop ({LOOP.describe()}) that rt.save'd after {SAVE_AFTER} "
            f"steps, then rt.load'ed in a new Runtime and finished ends {diff:.3g} away from "
            f"the uninterrupted loop (allowed {tolerance:g} in {dtype})",
        )
    one_loop = LOOP.in_one_process(world)
    with tempfile.TemporaryDirectory(prefix="distkit-contract-") as tmp:
        path = Path(tmp) / "saved.pt"
        path.write_bytes(results[0]["file"])
        one = in_one_process(one_loop, dtype, resume_from=path)
    diff = max_abs_diff(one["weights"], results[0]["whole"]["weights"])
    expect(
        diff <= tolerance,
        f"the file rt.save wrote at {world} process(es) after {SAVE_AFTER} steps, loaded by "
        f"one process ({reference_strategy()!r}) at {one_loop.describe()} and finished, ends "
        f"{diff:.3g} away from the uninterrupted loop at {world} process(es) (allowed "
        f"{tolerance:g} in {dtype}): the file must hold the full state, in the user's own keys (if "
        "runtime_accumulation fails too, the steps themselves differ)",
    )


RUNTIME_CHECKPOINT_ROUND_TRIP = Promise(
    "runtime_checkpoint_round_trip",
    "a user loop rt.save'd mid-epoch, rt.load'ed by a new Runtime at the same world size "
    f"and by one process, finishes as if uninterrupted (within {TOLERANCE:g} in float64)",
    _body,
    _verify,
)
