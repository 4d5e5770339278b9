"""Which global batch plan a loader's data gets: the loader's own sampling, sharded alike.

A user's batch sampler (length bucketing, ...) or sampler (``WeightedRandomSampler``, ...)
draws the epoch the same way on every rank, and the plan shards its draw; otherwise the plan
is distkit's seeded permutation (or the data in order, without ``shuffle``).
"""

from __future__ import annotations

from typing import Any

from distkit.data import GlobalBatchPlan, LoaderSpec
from distkit.data._samplers import BatchSamplerPlan, SamplerPlan
from distkit.data._stream_spec import StreamSpec


def batch_plan(
    spec: LoaderSpec | StreamSpec,
    *,
    world_size: int,
    rank: int,
    grad_accum_steps: int,
    seed: int,
    drop_last: bool,
) -> GlobalBatchPlan | None:
    """The global batches of ``spec``'s data for ``rank`` of ``world_size`` (None: a
    stream, whose batches are learnt as it goes). ``drop_last``: the caller's own setting
    (a DataLoader's ``drop_last=True`` holds as well)."""
    if isinstance(spec, StreamSpec):
        return None
    common: dict[str, Any] = {
        "world_size": world_size,
        "rank": rank,
        "grad_accum_steps": grad_accum_steps,
        "seed": seed,
        "drop_last": spec.drop_last or drop_last,
    }
    if spec.batch_sampler is not None:
        return BatchSamplerPlan(spec.batch_sampler, **common)
    if spec.sampler is not None:
        return SamplerPlan(spec.sampler, batch_size=spec.batch_size, **common)
    return GlobalBatchPlan(len(spec), batch_size=spec.batch_size, shuffle=spec.shuffle, **common)
