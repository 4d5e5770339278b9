"""The default process group distkit makes is shared by every Trainer and Runtime of the
process, and goes with the last of them (distkit/strategies/_group_lease.py). These run in a
world of one, in the test process; tests/trainer/test_many_trainers.py runs sweeps under
torchrun x2, where a dropped Trainer must not destroy the group on one rank only."""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distkit
from distkit.errors import ConfigurationError
from distkit.strategies import _group_lease
from tests.support.workloads import make_dataset, make_mlp


def fit(trainer: distkit.Trainer) -> int:
    model = make_mlp()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(8),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    return trainer.global_step


def trainer(strategy: object = "ddp", **kwargs: object) -> distkit.Trainer:
    return distkit.Trainer(strategy, batch_size=4, max_epochs=1, progress=False, **kwargs)


def test_closing_the_first_of_two_trainers_leaves_the_group_to_the_second():
    first, second = trainer("ddp"), trainer("fsdp")
    assert _group_lease.holders() == 2
    first.close()
    assert dist.is_initialized() and _group_lease.holders() == 1
    assert fit(second) == 2
    second.close()
    assert not dist.is_initialized()


def test_a_reassigned_trainer_dropped_after_the_next_one_joined_does_not_take_the_group():
    """The issue's sweep: the loop's reassignment drops the old Trainer only once the new
    one exists. Before, the old one's teardown destroyed the group: torch's 'Default process
    group has not been initialized' at the second fit."""
    current = trainer("ddp")
    for strategy in ("fsdp", "ddp"):
        assert fit(current) == 2
        current = trainer(strategy)
        gc.collect()
        assert _group_lease.holders() == 1
    assert fit(current) == 2
    current.close()
    assert not dist.is_initialized()


def test_runtimes_share_the_group_and_the_last_close_destroys_it():
    with distkit.Runtime("ddp") as outer:
        with distkit.Runtime("fsdp") as inner:
            assert inner.all_reduce(torch.tensor([2.0]), op="sum").item() == 2.0
        assert dist.is_initialized()
        assert outer.all_reduce(torch.tensor([3.0]), op="sum").item() == 3.0
    assert not dist.is_initialized()


def test_a_later_trainer_joins_with_its_own_collective_timeout():
    first = trainer("ddp", collective_timeout=60)
    second = trainer("ddp", collective_timeout=5)
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert backend.options._timeout == timedelta(seconds=5)
    second.close()
    first.close()


def test_a_later_strategy_naming_another_backend_is_refused_naming_both():
    first = trainer(distkit.DDPStrategy(backend="gloo"))
    with pytest.raises(ConfigurationError, match=r"backend='nccl'.*'gloo'.*same backend"):
        trainer(distkit.DDPStrategy(backend="nccl"))
    assert dist.is_initialized() and _group_lease.holders() == 1  # the refusal took none
    first.close()
    assert not dist.is_initialized()


def test_a_group_the_user_made_is_joined_and_never_destroyed():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with trainer("ddp") as t:
            assert fit(t) == 2
            assert _group_lease.holders() == 0
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
