"""A plain DataLoader in a Runtime loop under N ranks gives every rank all the data: each
step then trains on N times its samples, a wrong result nothing else reports. The first
``rt.backward`` outside ``rt.loader`` compares a fingerprint of every rank's first training
batch (once; nothing afterwards) and stops every rank, naming ``rt.loader`` and
``DistributedSampler``, when they are all the same; ``same_data_on_every_rank=True`` says it
is meant. A loop that shards by itself (a ``DistributedSampler``) and one process are not
stopped. Real gloo processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import distkit
from distkit.errors import ConfigurationError
from tests.support.workloads import make_dataset

pytestmark = pytest.mark.timeout(300)


def plain_loop(how: str, same: bool = False) -> dict[str, Any]:
    """Two epochs over a DataLoader the Runtime did not make; what happened."""
    dataset = make_dataset(24)
    with distkit.Runtime("ddp", seed=0, same_data_on_every_rank=same) as rt:
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = rt.setup(model, optimizer)
        if how == "distributed":
            sampler = DistributedSampler(dataset, shuffle=True, seed=0)
            loader = DataLoader(dataset, batch_size=4, sampler=sampler)
        else:
            sampler = None
            loader = DataLoader(dataset, batch_size=4, shuffle=how == "shuffled")
        steps = 0
        try:
            for epoch in range(2):
                if sampler is not None:
                    sampler.set_epoch(epoch)
                for x, y in loader:
                    rt.backward(nn.functional.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                    steps += 1
        except ConfigurationError as error:
            return {"error": str(error), "steps": steps}
        return {"error": None, "steps": steps}


@pytest.mark.parametrize("how", ["plain", "shuffled"])
def test_a_plain_dataloader_under_two_ranks_stops_at_the_first_step(run_on_ranks, how):
    for rank in run_on_ranks(plain_loop, how, world_size=2):
        assert rank["steps"] == 0  # nothing trained on the wrong data
        assert "rt.loader" in rank["error"] and "DistributedSampler" in rank["error"]
        assert "same_data_on_every_rank=True" in rank["error"]


def test_a_loop_that_shards_by_itself_and_one_process_are_not_stopped(run_on_ranks):
    for rank in run_on_ranks(plain_loop, "distributed", world_size=2):
        assert rank == {"error": None, "steps": 6}  # 12 samples per rank, batch 4, 2 epochs
    assert run_on_ranks(plain_loop, "plain", world_size=1) == [{"error": None, "steps": 12}]


def test_the_same_data_on_every_rank_on_purpose_is_not_stopped(run_on_ranks):
    ranks = run_on_ranks(plain_loop, "plain", True, world_size=2)
    assert ranks == [{"error": None, "steps": 12}] * 2


def test_same_data_on_every_rank_takes_a_bool():
    with pytest.raises(ConfigurationError, match="same_data_on_every_rank"):
        distkit.Runtime("dp", same_data_on_every_rank="yes")
