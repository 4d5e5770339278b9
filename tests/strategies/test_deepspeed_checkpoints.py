"""Checkpoints under strategy="deepspeed" that other backends wrote sharded: fsdp's
``checkpoint="sharded"`` folders (torch.distributed.checkpoint) into DeepSpeed's engines,
before their set-up (a resumed fit) and after it (``trainer.load_checkpoint``). ZeRO keeps
its own fp32 master weights and optimizer partitions, so writing into the module's tensors
alone would be overwritten at the next step, silently."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from tests.support.gates import needs
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = [needs("deepspeed"), pytest.mark.timeout(300)]

TOL = 1e-5
#: every parameter partitioned at stage 3 (DeepSpeed keeps small ones whole by default)
SMALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _strategy(name: str, stage: int) -> Any:
    if name == "deepspeed":
        return distkit.DeepSpeedStrategy(stage=stage, config=SMALL)
    if name == "fsdp-sharded":
        return distkit.FSDPStrategy(checkpoint="sharded")
    return name


def _net() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def fit(name: str, batch: int, folder: str | None, *, stage: int = 3, **settings: Any) -> dict:
    trainer = distkit.Trainer(_strategy(name, stage), batch_size=batch, max_epochs=2, seed=11,
                              progress=False, checkpoint_dir=folder, **settings)  # fmt: skip
    net, optimizer = _net()
    trainer.fit(net, optimizer, make_dataset(64), loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(), "steps": trainer.global_step}
    trainer.close()
    return out


def load_after_setup(path: str, stage: int) -> dict:
    """Fit 2 steps (other weights, ZeRO's state made), load the checkpoint into the set-up
    engine, then fit to the end."""
    trainer = distkit.Trainer(_strategy("deepspeed", stage), batch_size=4, max_epochs=2,
                              seed=11, progress=False, max_steps=2)  # fmt: skip
    net, optimizer = _net()
    data = make_dataset(64)
    trainer.fit(net, optimizer, data, loss_fn=nn.functional.cross_entropy)
    trainer.load_checkpoint(path)
    trainer.max_steps = None
    trainer.fit(net, optimizer, data, loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(), "steps": trainer.global_step}
    trainer.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_an_fsdp_sharded_checkpoint_resumes_under_deepspeed_before_and_after_setup(
    run_on_ranks, tmp_path, stage
):
    whole = run_on_ranks(fit, "ddp", 8, None, world_size=1)[0]
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(fit, max_steps=5, checkpoint_every=5), "fsdp-sharded", 4, str(folder),
                 world_size=2)  # fmt: skip
    saved = ckpt.CheckpointFolder(folder).latest()
    assert saved is not None and "shards" in ckpt.load(saved)
    resumed = run_on_ranks(partial(fit, stage=stage, resume=str(saved)), "deepspeed", 4, None,
                           world_size=2)  # fmt: skip
    loaded = run_on_ranks(load_after_setup, str(saved), stage, world_size=2)
    for name, runs in (("resumed", resumed), ("loaded after set-up", loaded)):
        for rank in runs:
            assert rank["steps"] == whole["steps"], name
            assert max_abs_diff(rank["state"], whole["state"]) <= TOL, name
