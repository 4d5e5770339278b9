"""What DeepSpeed's ``engine.step()`` cannot do, said before anything is set up, and the clip it
reads at each step."""

from __future__ import annotations

from typing import Any

from distkit.strategies._steps import GradientClip

#: why a loss may not run through two engines
CROSSING = (
    "under strategy='deepspeed' this loss runs through two models (each has its own "
    "DeepSpeed engine, whose hooks reduce its gradients only inside its own backward; DeepSpeed "
    "runs them for any loss through its forward): a GAN's generator loss through the "
    "discriminator, say. Train one model per loss (detach its input to the other model), or "
    "use strategy='ddp' or 'fsdp' for such loops"
)

#: why a hook between the reduction and the step cannot run
BEFORE_STEP = (
    "strategy='deepspeed' reduces, clips and applies the gradients in one call "
    "(engine.step()), so nothing can read or change them in between: a callback's "
    "on_before_optimizer_step and token-exact losses (distkit.Loss, rt.backward(total, "
    "count=...)) need that. Use a mean loss and no such callback, or strategy='fsdp' (sharded "
    "too) or 'ddp'"
)
SKIP_NONFINITE = (
    "nonfinite='skip' with strategy='deepspeed': DeepSpeed checks for overflow only with "
    "fp16 (its loss scaler skips such steps). Use nonfinite='raise' (the default: a "
    "non-finite loss stops training at the next check point)"
)
VALUE_CLIP = (
    "strategy='deepspeed' clips by norm only (its gradient_clipping, across the shards): use "
    "gradient_clip_norm=... / max_norm=..., not value clipping"
)


def refusal(
    *, before_step: bool, clip: GradientClip | None, skip_nonfinite: bool, precision: str
) -> str | None:
    """Why these step settings cannot run on DeepSpeed's engine, or None."""
    if before_step:
        return BEFORE_STEP
    if skip_nonfinite and precision != "fp16":
        return SKIP_NONFINITE
    if clip is not None and clip.max_value is not None:
        return VALUE_CLIP
    return None


def set_clip(engine: Any, max_norm: float | None) -> None:
    """This step's clipping norm (0: none). DeepSpeed reads it from its config at set-up;
    its ZeRO optimizer keeps it as ``clip_grad`` and reads that at each step."""
    value = float(max_norm or 0.0)
    engine._config.gradient_clipping = value
    engine.optimizer.clip_grad = value
