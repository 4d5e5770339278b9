"""apex opt levels and the trainer's ``precision``: one consistent reading, or a clear refusal."""

from __future__ import annotations

from dataclasses import dataclass

from distkit.errors import ApexLegacyApiMissingError, ConfigurationError
from distkit.launch import BUILTIN_CHOICES, StrategyChoices, native_alternative

OPT_LEVELS = ("O0", "O1", "O2", "O3")
_PRECISION_OF_LEVEL = {"O0": "32", "O1": "fp16", "O2": "fp16", "O3": "fp16"}
_DEFAULT_LEVEL = {"32": "O0", "fp16": "O1"}

# What a legacy opt level means, and what the modern (native torch) path runs instead.
LEVEL_TABLE = {
    "O0": ("fp32 everywhere", "fp32 (precision='32')"),
    "O1": ("torch functions patched to fp16, dynamic loss scale", "autocast fp16 + GradScaler"),
    "O2": (
        "fp16 model, fp32 master weights and BatchNorm, dynamic loss scale",
        "autocast fp16 + GradScaler (fp32 weights throughout; no fp16 model copy)",
    ),
    "O3": ("pure fp16, static loss scale 1", "autocast fp16 + GradScaler (not pure fp16)"),
}


@dataclass(frozen=True)
class ApexPlan:
    """How an apex run will compute.

    Attributes:
        opt_level: the apex opt level (legacy path) or the one being emulated (modern path).
        precision: the precision of distkit's own autocast/GradScaler ("32" on the legacy path,
            where apex.amp does the casting and the loss scaling itself).
        note: one sentence for the start-up message.
    """

    opt_level: str
    precision: str
    note: str


def resolve_plan(
    precision: str,
    opt_level: str | None,
    *,
    legacy: bool,
    strict: bool,
    choices: StrategyChoices = BUILTIN_CHOICES,
) -> ApexPlan:
    """Reconcile the trainer's ``precision`` with an ``opt_level`` for one apex generation.

    ``precision="32"`` means O0 and ``"fp16"`` means O1 unless ``opt_level`` says O2/O3;
    anything contradictory is refused rather than guessed.
    """
    if opt_level is not None and opt_level not in OPT_LEVELS:
        raise ConfigurationError(
            f"opt_level={opt_level!r} is not an apex opt level. Allowed: {', '.join(OPT_LEVELS)}"
        )
    if precision == "bf16":
        if legacy or opt_level is not None:
            raise ConfigurationError(
                "precision='bf16' has no apex.amp opt level (amp scales fp16 only). Use "
                "precision='fp16' with opt_level O1/O2, or "
                f"strategy={native_alternative(choices)!r} with precision='bf16'."
            )
        return ApexPlan("bf16", "bf16", "bf16 autocast (no opt level involved)")
    level = opt_level or _DEFAULT_LEVEL[precision]
    if _PRECISION_OF_LEVEL[level] != precision:
        wanted = _PRECISION_OF_LEVEL[level]
        raise ConfigurationError(
            f"opt_level={level!r} trains in {'fp32' if wanted == '32' else 'fp16'} but the "
            f"Trainer has precision={precision!r}. Pass precision={wanted!r} to the Trainer "
            f"together with opt_level={level!r} (precision='32' means O0, 'fp16' means O1)."
        )
    if legacy:
        return ApexPlan(level, "32", f"apex.amp opt_level {level}: {LEVEL_TABLE[level][0]}")
    if strict and level in ("O2", "O3"):
        raise ApexLegacyApiMissingError(
            f"strict=True: opt_level {level} ({LEVEL_TABLE[level][0]}) needs apex.amp, which "
            "apex >= 25.07 removed. Install apex 25.04 for the legacy API, or drop strict=True "
            f"to run {LEVEL_TABLE[level][1]} instead."
        )
    return ApexPlan(level, precision, f"opt_level {level} mapped to {LEVEL_TABLE[level][1]}")
