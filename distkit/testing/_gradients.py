"""Promises about gradients: local inside ``no_sync``, the mean over ranks after the step.

The model is ``nn.Linear(4, 1)`` and each rank's batch is two rows of ``rank + 1``, so every
rank's own gradient, and their mean, are known in closed form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit.testing._promise import Promise, close, expect
from distkit.testing._setup import set_up
from distkit.testing._target import StrategyUnderTest


def _gradients(model: nn.Module) -> dict[str, Any]:
    """Each parameter's full gradient as a list (None where it has none); gathers sharded ones."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()  # a DTensor shard (FSDP): a collective on every rank
        out[name] = None if grad is None else grad.detach().cpu().tolist()
    return out


def _accumulate(target: StrategyUnderTest) -> dict[str, Any]:
    """Two backward passes of a rank-dependent batch: the first inside no_sync, then a step."""
    with target.trainer(grad_accum_steps=2) as trainer:
        s = trainer.strategy
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        wrapped, optimizer = set_up(s, model)
        x = torch.full((2, 4), float(s.rank + 1), device=s.device)
        with s.no_sync(wrapped):
            with s.autocast():
                loss = wrapped(x).sum()
            s.backward(loss, optimizer)
        inside = _gradients(model)
        with s.autocast():
            loss = wrapped(x).sum()
        s.backward(loss, optimizer)
        outcome = s.optimizer_step(optimizer)
        return {"inside": inside, "stepped": outcome.stepped, "after": _gradients(model)}


def _own_gradients(rank: int, passes: int) -> dict[str, Any]:
    # d(sum(Wx + b))/dW is the sum of the batch's 2 rows of (rank + 1); d/db is 2
    return {"weight": [[passes * 2.0 * (rank + 1)] * 4], "bias": [passes * 2.0]}


def _mean_gradients(world: int, passes: int) -> dict[str, Any]:
    mean = sum(passes * 2.0 * (k + 1) for k in range(world)) / world
    return {"weight": [[mean] * 4], "bias": [passes * 2.0]}


def _no_sync_body(target: StrategyUnderTest, workdir: Path) -> dict[str, Any]:
    return _accumulate(target)["inside"]


def _verify_no_sync(results: list[dict[str, Any]], world: int) -> None:
    mean = _mean_gradients(world, passes=1)
    for rank, inside in enumerate(results):
        if all(grad is None for grad in inside.values()):
            continue  # kept aside until the synchronising backward (FSDP2): nothing reduced
        own = _own_gradients(rank, passes=1)
        communicated = world > 1 and close(inside, mean)
        expect(
            close(inside, own),
            f"rank {rank}: after one backward inside no_sync its gradients are {inside}; its "
            f"own are {own}"
            + (" (they are the mean over ranks: they were all-reduced)" if communicated else ""),
        )


def _mean_gradients_body(target: StrategyUnderTest, workdir: Path) -> dict[str, Any]:
    result = _accumulate(target)
    return {"stepped": result["stepped"], "after": result["after"]}


def _verify_mean_gradients(results: list[dict[str, Any]], world: int) -> None:
    mean = _mean_gradients(world, passes=2)
    for rank, r in enumerate(results):
        expect(r["stepped"] is True, f"rank {rank}: optimizer_step() did not step")
        expect(
            close(r["after"], mean),
            f"rank {rank}: after two accumulated backward passes and the step its gradients are "
            f"{r['after']}; expected the mean over ranks of each rank's sum, {mean}"
            + (f" (its own sum is {_own_gradients(rank, 2)})" if world > 1 else ""),
        )


NO_SYNC_IS_LOCAL = Promise(
    "no_sync_is_local",
    "a backward inside no_sync leaves each rank its own gradients (no communication)",
    _no_sync_body,
    _verify_no_sync,
)
MEAN_GRADIENTS = Promise(
    "mean_gradients",
    "after the step the gradients are the mean over ranks of each rank's accumulated ones",
    _mean_gradients_body,
    _verify_mean_gradients,
)
