"""A user's own loop on :class:`distkit.Runtime`, as the Runtime promises train it.

The loop of docs/runtime.md over the workload (:mod:`distkit.testing._workload`):
``rt.setup``, ``rt.loader``, ``rt.backward``, ``rt.clip_gradients`` where asked,
``optimizer.step()`` and ``optimizer.zero_grad()``; ``rt.save`` after some optimizer steps, or
``rt.load`` before the first. Its reference is the same loop in one plain CPU process that
takes every optimizer step's samples in one batch, without accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit.testing._processes import in_plain_process
from distkit.testing._target import StrategyUnderTest
from distkit.testing._workload import (
    BATCH_SIZE,
    DATA_SEED,
    dataset,
    model,
    optimizer,
    reference_strategy,
    trained_in,
)


@dataclass(frozen=True)
class Loop:
    """What the loop does, the same on every rank.

    Attributes:
        batch_size: samples per process per micro-batch.
        grad_accum_steps: micro-batches per optimizer step (the Runtime's).
        clip_norm: ``rt.clip_gradients(model, optimizer, max_norm=clip_norm)`` before every
            step (None: no clipping).
        epochs: passes over the workload's 61 samples.
    """

    batch_size: int = BATCH_SIZE
    grad_accum_steps: int = 1
    clip_norm: float | None = None
    epochs: int = 2

    def in_one_process(self, world_size: int) -> Loop:
        """The same optimizer steps in one process: each step's samples in one batch."""
        samples = self.batch_size * world_size * self.grad_accum_steps
        return replace(self, batch_size=samples, grad_accum_steps=1)

    def describe(self) -> str:
        """The loop in a few words, for messages."""
        words = f"batch size {self.batch_size}"
        if self.grad_accum_steps > 1:
            words += f", grad_accum_steps={self.grad_accum_steps}"
        if self.clip_norm is not None:
            words += f", clip_gradients(max_norm={self.clip_norm})"
        return words


def train(
    target: StrategyUnderTest,
    loop: Loop,
    *,
    model_seed: int = 0,
    save_after: int | None = None,
    save_to: Path | None = None,
    resume_from: Path | None = None,
) -> dict[str, Any]:
    """Run ``loop`` on a new Runtime of ``target``.

    With ``save_after``, ``rt.save`` to ``save_to`` after that many optimizer steps and stop
    there, as if the job were killed. With ``resume_from``, ``rt.load`` it first and finish.

    Returns:
        ``weights``: the full weights at the end; ``norms``: each step's gradient norm before
        clipping (with ``clip_norm``); ``steps``: the optimizer steps this run took.
    """
    with target.runtime(grad_accum_steps=loop.grad_accum_steps, seed=DATA_SEED) as rt:
        net = model(model_seed, target.dtype)
        net, opt = rt.setup(net, optimizer(net))
        loader = rt.loader(dataset(target.dtype), batch_size=loop.batch_size, shuffle=True)
        first = 0
        if resume_from is not None:
            state = {"model": net, "optimizer": opt, "loader": loader}
            first = rt.load(resume_from, state)["epoch"]
        norms: list[float] = []
        steps = 0
        for epoch in range(first, loop.epochs):
            for x, y in loader:
                rt.backward(nn.functional.cross_entropy(net(x), y))
                if loop.clip_norm is not None:
                    rt.clip_gradients(net, opt, max_norm=loop.clip_norm)
                opt.step()
                opt.zero_grad()
                if not rt.sync_gradients:
                    continue  # mid-window: step() and zero_grad() did nothing
                steps += 1
                if opt.last_grad_norm is not None:
                    norms.append(float(opt.last_grad_norm))
                if steps == save_after:
                    assert save_to is not None
                    state = {"model": net, "optimizer": opt, "loader": loader, "epoch": epoch}
                    rt.save(save_to, state)
                    return _outcome(rt, net, target.dtype, norms, steps)
        return _outcome(rt, net, target.dtype, norms, steps)


def _outcome(
    rt: Any, net: nn.Module, dtype: torch.dtype, norms: list[float], steps: int
) -> dict[str, Any]:
    weights = trained_in(rt.full_state_dict(net), dtype)
    return {"weights": weights, "norms": norms, "steps": steps}


def _train_reference(loop: Loop, resume_from: Path | None, dtype: torch.dtype) -> dict[str, Any]:
    target = StrategyUnderTest(reference_strategy(), dtype=dtype)
    return train(target, loop, resume_from=resume_from)


def in_one_process(
    loop: Loop, dtype: torch.dtype, *, resume_from: Path | None = None
) -> dict[str, Any]:
    """``loop`` (resumed from ``resume_from``) in one plain CPU process of the reference
    strategy, in ``dtype``; what :func:`train` returns."""
    return in_plain_process(_train_reference, loop, resume_from, dtype)


@cache
def reference(loop: Loop, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """What ``loop`` at ``world_size`` processes in ``dtype`` must equal: one process with
    each step's samples in one batch (computed once per loop, world size and dtype)."""
    return in_one_process(loop.in_one_process(world_size), dtype)
