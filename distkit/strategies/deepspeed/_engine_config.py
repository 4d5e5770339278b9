"""The DeepSpeed config distkit hands ``deepspeed.initialize``: the user's, plus what distkit owns.

distkit feeds the batches, weights each micro-batch's loss by its share of the step's samples,
decides where each optimizer step falls (uneven last windows included), clips, and casts. So
it runs DeepSpeed with ``managed_gradient_accumulation: false`` (every ``engine.step()`` is an
accumulation boundary; ``engine.backward`` accumulates), and sets the keys that would
otherwise disagree with the Trainer or Runtime. A user config that sets one of those keys is
refused, naming the distkit argument that says the same thing.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any

from distkit.errors import ConfigurationError

STAGES = (1, 2, 3)

#: keys distkit sets itself -> where a user says the same thing
OWNED: Mapping[str, str] = {
    "train_batch_size": "Trainer(batch_size=...) / rt.loader(batch_size=...): per process",
    "train_micro_batch_size_per_gpu": "Trainer(batch_size=...) / rt.loader(batch_size=...)",
    "gradient_accumulation_steps": "Trainer(grad_accum_steps=...) / Runtime(grad_accum_steps=...)",
    "managed_gradient_accumulation": "distkit decides where each step falls",
    "gradient_clipping": "Trainer(gradient_clip_norm=...) / rt.clip_gradients(...)",
    "fp16": "Trainer(precision='fp16') / Runtime(precision=...)",
    "bf16": "Trainer(precision='bf16') / Runtime(precision=...)",
    "bfloat16": "Trainer(precision='bf16') / Runtime(precision=...)",
    "amp": "Trainer(precision=...)",
    "torch_autocast": "Trainer(precision=...): distkit runs the forward under torch's autocast",
    "optimizer": "pass your torch.optim optimizer to fit / rt.setup",
    "scheduler": "pass your LR scheduler to fit (scheduler=...) or step it in your loop",
}


#: DeepSpeed's default for its reduce and all-gather buckets (elements)
DEEPSPEED_BUCKET = 500_000_000
#: the smallest bucket distkit picks (elements): fewer, larger collectives for small models
MIN_BUCKET = 2**20
#: what a bucket's size is a multiple of (DeepSpeed asserts its all-gather bucket is a
#: multiple of its NCCL alignment factor, 2 in 0.19.8; 256 leaves room for larger ones)
BUCKET_ALIGNMENT = 256
#: the ZeRO buckets distkit sizes to the model unless the user's config sets them
BUCKETS = ("reduce_bucket_size", "allgather_bucket_size")


def engine_config(
    user: Mapping[str, Any] | None,
    *,
    stage: int | None,
    precision: str,
    parameters: int | None = None,
    world_size: int = 1,
) -> dict[str, Any]:
    """The config for one ``deepspeed.initialize``.

    Args:
        user: the ``DeepSpeedStrategy(config=...)`` dict (None: empty).
        stage: ``DeepSpeedStrategy(stage=...)``; None takes the config's
            ``zero_optimization.stage``, else 2.
        precision: distkit's precision name (``"32"``, ``"bf16"``, ``"fp16"``).
        parameters: the model's parameter count (elements), and ``world_size`` the ranks':
            ZeRO's reduce and all-gather buckets unset in ``user`` hold one rank's share of
            the parameters (at least :data:`MIN_BUCKET`, at most DeepSpeed's 5e8). DeepSpeed's
            default allocates a 1.9 GiB fp32 bucket per rank whatever the model's size
            (measured: ``benchmarks/memory.py``); a bucket of 1/N of the model costs at most
            what the rank's gradient partition costs, and fills N times per backward.
    """
    config = copy.deepcopy(dict(user or {}))
    clashes = sorted(key for key in OWNED if key in config)
    if clashes:
        raise ConfigurationError(
            "DeepSpeedStrategy(config=...) sets "
            + ", ".join(repr(key) for key in clashes)
            + ", which distkit sets itself; say it through distkit instead: "
            + "; ".join(f"{key}: {OWNED[key]}" for key in clashes)
        )
    zero = dict(config.get("zero_optimization") or {})
    config["zero_optimization"] = zero
    zero["stage"] = resolve_stage(stage, zero.get("stage"))
    if parameters is not None:
        share = -(-parameters // max(1, world_size))  # one rank's, rounded up
        share = -(-share // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT
        for key in BUCKETS:
            zero.setdefault(key, min(DEEPSPEED_BUCKET, max(MIN_BUCKET, share)))
    config.update(
        {
            # bookkeeping only: distkit feeds the micro-batches and weights their losses
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": 0.0,  # set per step from distkit's clip (see the strategy)
            # a torch.optim optimizer DeepSpeed has not tested with ZeRO is still stepped as
            # torch steps it (SGD, AdamW, ...): the tests hold it to a one-process loop
            "zero_allow_untested_optimizer": True,
        }
    )
    config.setdefault("steps_per_print", 2**31 - 1)  # distkit logs; DeepSpeed stays quiet
    config.setdefault("wall_clock_breakdown", False)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True}  # DeepSpeed's own dynamic loss scaler
    return config


def resolve_stage(stage: int | None, configured: Any) -> int:
    """The ZeRO stage from the argument and the config (they must agree)."""
    for name, value in (("stage", stage), ("config's zero_optimization.stage", configured)):
        if value is not None and (isinstance(value, bool) or value not in STAGES):
            hint = " (stage 0 is plain data parallelism: use strategy='ddp')" if value == 0 else ""
            raise ConfigurationError(
                f"DeepSpeedStrategy: {name}={value!r}; allowed: 1 (optimizer state sharded), "
                f"2 (and gradients), 3 (and parameters){hint}"
            )
    if stage is not None and configured is not None and stage != configured:
        raise ConfigurationError(
            f"DeepSpeedStrategy(stage={stage}) and config zero_optimization.stage={configured} "
            "disagree: give the stage once"
        )
    if stage is not None:
        return stage
    return int(configured) if configured is not None else 2


class _Reads(dict[str, Any]):
    """A config dict that remembers which top-level keys were looked up."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def check_known_keys(config: dict[str, Any], config_class: Any) -> None:
    """Refuse a top-level key DeepSpeed does not read (``zero_optimisation``: DeepSpeed
    ignores it and trains at its default stage, without a word), naming the nearest it
    reads. ``config_class``: the installed ``deepspeed.runtime.config.DeepSpeedConfig``,
    which looks up every key it knows (its nested sections already refuse unknown keys).
    Parsing errors are left to ``deepspeed.initialize``, which reports them."""
    reads = _Reads(config)
    try:
        config_class(reads)
    except Exception:
        return
    unknown = sorted(key for key in config if key not in reads.read)
    if unknown:
        key = unknown[0]
        near = difflib.get_close_matches(key, sorted(reads.read), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ConfigurationError(
            f"DeepSpeedStrategy(config=...) has the key {key!r}, which this DeepSpeed does "
            f"not read: it would be ignored without a word (a misspelt zero_optimization "
            f"trains at another ZeRO stage).{hint} Correct or remove it"
            + (f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else "")
        )
