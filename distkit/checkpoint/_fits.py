"""Why a saved model state does not fit a model: checked before anything is loaded (pure).

The Trainer's resume and a Runtime's ``rt.load`` both refuse a state that would load wrong
or not at all, naming each difference, so that a refusal leaves the model as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def model_misfits(
    saved: dict[str, Any], current: dict[str, torch.Size | None], model: nn.Module
) -> list[str]:
    """Why ``saved`` (a model state) cannot load into ``model`` whose entries have the full
    shapes ``current``: other shapes, missing or extra keys, an integer tensor for a
    floating-point entry (torch would cast it without a word). Checked before anything is
    loaded, so a refusal leaves the model as it was. Pure."""
    problems = [
        f"{key}: checkpoint {tuple(saved[key].shape)}, model {tuple(shape)}"
        for key, shape in current.items()
        if key in saved
        and shape is not None
        and isinstance(saved[key], torch.Tensor)
        and saved[key].shape != shape
    ]
    mine = model.state_dict(keep_vars=True)
    problems += [
        f"{key}: checkpoint {saved[key].dtype}, model {mine[key].dtype} (an integer tensor "
        "does not load into a floating-point one)"
        for key in current
        if key in saved
        and key in mine
        and isinstance(saved[key], torch.Tensor)
        and isinstance(mine[key], torch.Tensor)
        and mine[key].is_floating_point()
        and not saved[key].is_floating_point()
        and not saved[key].is_complex()
    ]
    missing = [key for key in current if key not in saved]
    unexpected = [key for key in saved if key not in current]
    if missing:
        problems.append(f"not in the checkpoint: {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected[:5])}")
    return problems
