"""A promise about a user loop with two models: a GAN's, trained like one process.

A generator and a discriminator, each set up with its own optimizer (Adam and SGD); two
``rt.backward`` calls per batch, the second reaching both models' parameters (the
generator's loss goes through the discriminator). The generator's input is a function of
the batch, so every world size draws the same.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit.testing._processes import in_plain_process
from distkit.testing._promise import Promise, expect, max_abs_diff
from distkit.testing._target import StrategyUnderTest
from distkit.testing._workload import (
    BATCH_SIZE,
    DATA_SEED,
    TOLERANCE,
    dataset,
    dtype_of,
    reference_strategy,
    tolerance_of,
    trained_in,
)

EPOCHS = 2


def train_two_models(target: StrategyUnderTest, batch_size: int) -> dict[str, Any]:
    """The GAN loop on a new Runtime of ``target``; both models' full final weights."""
    with target.runtime(seed=DATA_SEED) as rt:
        torch.manual_seed(0)
        dtype = target.dtype
        gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6)).to(dtype)
        disc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)
        gen, opt_g = rt.setup(gen, torch.optim.Adam(gen.parameters(), lr=1e-2))
        disc, opt_d = rt.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
        bce = nn.functional.binary_cross_entropy_with_logits
        loader = rt.loader(dataset(dtype), batch_size=batch_size, shuffle=True)
        for _ in range(EPOCHS):
            for x, _ in loader:
                real = torch.ones(len(x), 1, dtype=x.dtype, device=x.device)
                fake_labels = torch.zeros_like(real)
                fake = gen(torch.tanh(x[:, :4]))
                scores = disc(torch.cat([x, fake.detach()]))
                opt_d.zero_grad()
                rt.backward(bce(scores, torch.cat([real, fake_labels])))
                opt_d.step()
                opt_g.zero_grad()
                # reaches both models: name the optimizer (legacy apex scales the loss with
                # its loss scale; every other backend checks it and goes on)
                rt.backward(bce(disc(fake), real), optimizer=opt_g)
                opt_g.step()
        return {
            "generator": trained_in(rt.full_state_dict(gen), dtype),
            "discriminator": trained_in(rt.full_state_dict(disc), dtype),
        }


def _train_reference(batch_size: int, dtype: torch.dtype) -> dict[str, Any]:
    return train_two_models(StrategyUnderTest(reference_strategy(), dtype=dtype), batch_size)


@cache
def _reference(world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    return in_plain_process(_train_reference, world_size * BATCH_SIZE, dtype)


def _body(target: StrategyUnderTest, workdir: Path) -> Any:
    return train_two_models(target, BATCH_SIZE)


def _verify(results: list[dict[str, Any]], world: int) -> None:
    dtype, tolerance = dtype_of(results[0]["generator"]), tolerance_of(results[0]["generator"])
    one = _reference(world, dtype)
    for rank, r in enumerate(results):
        for name in ("generator", "discriminator"):
            diff = max_abs_diff(r[name], one[name])
            expect(
                diff <= tolerance,
                f"rank {rank}: with two models, two optimizers and two rt.backward calls per "
                f"batch, {world} process(es) at batch size {BATCH_SIZE} end with a {name} "
                f"{diff:.3g} away from one process ({reference_strategy()!r}) at batch size "
                f"{world * BATCH_SIZE} (allowed {tolerance:g} in {dtype})",
            )


RUNTIME_TWO_MODELS = Promise(
    "runtime_two_models",
    "a GAN's loop (two models, two optimizers, two rt.backward per batch) at N processes "
    f"with batch b trains like one process at N * b (within {TOLERANCE:g} in float64)",
    _body,
    _verify,
)
