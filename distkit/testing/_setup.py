"""Promises about ``setup``: every rank starts from rank 0's weights; unwrap gives them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit.strategies.base import Strategy
from distkit.testing._promise import Promise, expect, max_abs_diff
from distkit.testing._target import StrategyUnderTest


def set_up(s: Strategy, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``s.setup`` with an SGD optimizer that never moves the weights (lr=0)."""
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return s.setup(model, optimizer)


def _identical_initial_weights_body(target: StrategyUnderTest, workdir: Path) -> dict[str, Any]:
    with target.trainer() as trainer:
        s = trainer.strategy
        torch.manual_seed(100 + s.rank)  # deliberately different initial weights on each rank
        model = nn.Linear(4, 1)
        before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        set_up(s, model)
        return {"before": before, "after": s.state_io.model_state_dict(model)}


def _verify_identical_initial_weights(results: list[dict[str, Any]], world: int) -> None:
    rank0 = results[0]["before"]
    for rank, r in enumerate(results):
        diff = max_abs_diff(r["after"], rank0)
        expect(
            diff == 0.0,
            f"after setup, rank {rank}'s weights differ from rank 0's initial weights by "
            f"{diff:.3g}: every rank must start from rank 0's",
        )


def _unwrap_body(target: StrategyUnderTest, workdir: Path) -> dict[str, Any]:
    with target.trainer() as trainer:
        s = trainer.strategy
        model = nn.Linear(4, 1)
        wrapped, _ = set_up(s, model)
        unwrapped = s.unwrap(wrapped)
        return {
            "is_model": unwrapped is model,
            "wrapped": type(wrapped).__qualname__,
            "unwrapped": type(unwrapped).__qualname__,
        }


def _verify_unwrap(results: list[dict[str, Any]], world: int) -> None:
    for rank, r in enumerate(results):
        expect(
            r["is_model"],
            f"rank {rank}: unwrap() of the set-up model ({r['wrapped']}) returned a "
            f"{r['unwrapped']} that is not the user's own module",
        )


IDENTICAL_INITIAL_WEIGHTS = Promise(
    "identical_initial_weights",
    "after setup every rank holds rank 0's initial weights",
    _identical_initial_weights_body,
    _verify_identical_initial_weights,
)
UNWRAP = Promise(
    "unwrap",
    "unwrap() of the set-up model is the user's own module",
    _unwrap_body,
    _verify_unwrap,
)
