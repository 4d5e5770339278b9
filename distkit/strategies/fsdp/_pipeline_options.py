"""FSDPStrategy's pipeline options, checked when the strategy is made (no model needed)."""

from __future__ import annotations

from typing import Any

from distkit.errors import ConfigurationError

SCHEDULES = ("gpipe", "1F1B", "interleaved1F1B")


def checked_options(
    pipeline: Any, split: Any, microbatches: Any, schedule: Any, stages_per_rank: Any
) -> tuple[int, int, int]:
    """The options checked at construction: ``(pipeline, microbatches, stages_per_rank)``."""
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
        raise ConfigurationError(
            f"FSDPStrategy(pipeline_parallel={pipeline!r}); allowed: an int >= 1, the pipeline "
            "stages (pipeline_parallel=2 with pipeline_split=['blocks.2'])"
        )
    if pipeline == 1:
        _refuse_without_pipeline(split, microbatches, schedule, stages_per_rank)
        return 1, 1, 1
    stages_per_rank = _checked_stages_per_rank(schedule, stages_per_rank)
    stages = pipeline * stages_per_rank
    microbatches = _checked_microbatches(microbatches, schedule, pipeline, stages)
    _check_split(split, pipeline, stages, stages_per_rank)
    return pipeline, microbatches, stages_per_rank


def _refuse_without_pipeline(
    split: Any, microbatches: Any, schedule: Any, stages_per_rank: Any
) -> None:
    given = [
        name
        for name, value in (
            ("pipeline_split", split),
            ("microbatches", microbatches),
            ("stages_per_rank", stages_per_rank),
        )
        if value is not None
    ]
    if given or schedule != "1F1B":
        name = given[0] if given else "schedule"
        raise ConfigurationError(
            f"FSDPStrategy({name}=...) without pipeline_parallel: it configures a "
            "pipeline. Add pipeline_parallel=N (N stages), or drop the option"
        )


def _checked_stages_per_rank(schedule: Any, stages_per_rank: Any) -> int:
    if schedule not in SCHEDULES:
        raise ConfigurationError(
            f"FSDPStrategy(schedule={schedule!r}); allowed: {', '.join(map(repr, SCHEDULES))} "
            "(torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B)"
        )
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule == "interleaved1F1B" else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int):
        raise ConfigurationError(
            f"FSDPStrategy(stages_per_rank={stages_per_rank!r}); allowed: an int >= 1"
        )
    if schedule == "interleaved1F1B" and stages_per_rank < 2:
        raise ConfigurationError(
            f"FSDPStrategy(schedule='interleaved1F1B', stages_per_rank={stages_per_rank}): "
            "interleaving needs at least 2 stages per rank (stages_per_rank=2), or use "
            "schedule='1F1B'"
        )
    if schedule != "interleaved1F1B" and stages_per_rank != 1:
        raise ConfigurationError(
            f"FSDPStrategy(schedule={schedule!r}, stages_per_rank={stages_per_rank}): "
            f"{schedule!r} runs one stage per rank; several stages per rank take "
            "schedule='interleaved1F1B'"
        )
    return stages_per_rank


def _checked_microbatches(microbatches: Any, schedule: str, pipeline: int, stages: int) -> int:
    if microbatches is None:
        return stages
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigurationError(
            f"FSDPStrategy(microbatches={microbatches!r}); allowed: an int >= 1 that divides "
            "the batch of each data-parallel group (batch_size)"
        )
    if schedule == "1F1B" and microbatches < stages:
        raise ConfigurationError(
            f"FSDPStrategy(schedule='1F1B', microbatches={microbatches}, pipeline_parallel="
            f"{pipeline}): 1F1B fills the pipeline before its first backward, so it needs at "
            f"least one micro-batch per stage (microbatches >= {stages}); or use "
            "schedule='gpipe'"
        )
    if schedule == "interleaved1F1B" and microbatches % pipeline:
        example = pipeline * max(1, microbatches // pipeline)
        raise ConfigurationError(
            f"FSDPStrategy(schedule='interleaved1F1B', microbatches={microbatches}, "
            f"pipeline_parallel={pipeline}): interleaved 1F1B needs microbatches a multiple "
            f"of pipeline_parallel (e.g. microbatches={example})"
        )
    return microbatches


def _check_split(split: Any, pipeline: int, stages: int, stages_per_rank: int) -> None:
    if split is None:
        raise ConfigurationError(
            f"FSDPStrategy(pipeline_parallel={pipeline}) needs pipeline_split: the names of the "
            f"{stages - 1} module(s) where a new stage begins (pipeline_split=['blocks.2']), "
            "or fn(model) returning the stage modules"
        )
    if isinstance(split, str):
        raise ConfigurationError(
            f"FSDPStrategy(pipeline_split={split!r}): a list of module names, one per cut "
            f"(pipeline_split=[{split!r}])"
        )
    if callable(split):
        return
    names = list(split)
    if not all(isinstance(n, str) for n in names):
        raise ConfigurationError(
            f"FSDPStrategy(pipeline_split={split!r}); allowed: a list of module names "
            "(str) or fn(model) -> the stage modules"
        )
    if len(names) != stages - 1:
        raise ConfigurationError(
            f"FSDPStrategy(pipeline_split={names}) names {len(names)} cut(s), and "
            f"pipeline_parallel={pipeline} x stages_per_rank={stages_per_rank} = {stages} "
            f"stages take {stages - 1}: one name per stage after the first"
        )
