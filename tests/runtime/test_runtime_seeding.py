"""``Runtime(seed=s)`` seeds torch, numpy and random at construction, alike on every rank: a
model built after it, with no ``torch.manual_seed`` of the user's, starts from the same weights
on one process and on every rank of N, on every backend, and the loop ends where one process
ends. From the loop's first ``rt.backward`` on each rank draws from ``seed + rank``; a
generator the user seeds in between is left alone. Real gloo / horovodrun processes."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import distkit
from tests.support import exactness
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = pytest.mark.timeout(300)
N = 21


def _build() -> nn.Module:
    """A model built with no seed of its own: its weights are whatever torch draws next."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(exactness.DTYPE)


def unseeded_loop(strategy: str, batch: int) -> dict[str, Any]:
    # generators left anywhere, another place on each rank (a fresh process's torch state is
    # the same everywhere: the test would pass without the Runtime's seeding)
    torch.manual_seed(os.getpid())
    np.random.seed(os.getpid())
    random.seed(os.getpid())
    with distkit.Runtime(strategy, seed=7) as rt:
        draws = {"torch": torch.rand(3), "numpy": np.random.rand(3), "random": random.random()}
        model = _build()
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        after_setup = torch.rand(3)  # still alike: nothing per rank before the first backward
        after_backward = None
        for _ in range(2):
            for x, y in rt.loader(make_dataset(N, dtype=exactness.DTYPE), batch_size=batch):
                rt.backward(nn.functional.cross_entropy(model(x), y))
                if after_backward is None:
                    after_backward = torch.rand(3)
                optimizer.step()
                optimizer.zero_grad()
        return {
            "draws": draws,
            "initial": initial,
            "after_setup": after_setup,
            "after_backward": after_backward,
            "state": rt.full_state_dict(model),
        }


def _check(ranks: list[dict[str, Any]], one: dict[str, Any]) -> None:
    for rank in ranks:
        # before the set-up every rank drew what one process draws
        assert torch.equal(rank["draws"]["torch"], one["draws"]["torch"])
        assert np.array_equal(rank["draws"]["numpy"], one["draws"]["numpy"])
        assert rank["draws"]["random"] == one["draws"]["random"]
        assert max_abs_diff(rank["initial"], one["initial"]) == 0.0  # the same weights
        assert max_abs_diff(rank["state"], one["state"]) <= exactness.TOL
        assert torch.equal(rank["after_setup"], one["after_setup"])
    # from the first backward on, each rank its own stream: seed + rank (rank 0's is one
    # process's)
    assert torch.equal(ranks[0]["after_backward"], one["after_backward"])
    assert not torch.equal(ranks[0]["after_backward"], ranks[1]["after_backward"])


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    from tests.support.multiprocess import run_on_ranks

    return run_on_ranks(unseeded_loop, "ddp", 8, world_size=1, agent_store=True)[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_model_built_after_the_runtime_starts_alike_on_one_process_and_n(
    run_on_ranks, one_process, strategy
):
    _check(run_on_ranks(unseeded_loop, strategy, 4, world_size=2), one_process)


@needs("horovod")
def test_horovod_ranks_start_from_the_one_process_weights(one_process, tmp_path):
    calls = [("tests.runtime.test_runtime_seeding", "unseeded_loop", ("horovod", 4), {})]
    _check([result for (result,) in run_with_horovodrun(calls, tmp_path)], one_process)


def two_runs_differ_only_by_seed() -> dict[str, Any]:
    out = {}
    for seed in (3, 3, 4):
        with distkit.Runtime("dp", seed=seed):
            out.setdefault(seed, []).append(_build().state_dict()["0.weight"].clone())
    return out


def test_the_seed_decides_the_weights_and_a_users_own_seed_is_kept():
    runs = two_runs_differ_only_by_seed()
    assert torch.equal(runs[3][0], runs[3][1])
    assert not torch.equal(runs[3][0], runs[4][0])
    for users_seed in (99, None):
        with distkit.Runtime("dp", seed=3) as rt:
            if users_seed is not None:
                torch.manual_seed(users_seed)  # the user's own, after the construction
            model = rt.setup(nn.Linear(2, 2))
            out = model(torch.ones(1, 2)).sum()
            before = torch.get_rng_state()
            rt.backward(out)
            left_alone = torch.equal(torch.get_rng_state(), before)
            assert left_alone == (users_seed is not None)  # else seed + rank from here on
