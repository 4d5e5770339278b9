"""Checkpoints under strategy="deepspeed" that other backends wrote sharded: fsdp's
``checkpoint="sharded"`` folders (torch.distributed.checkpoint) into DeepSpeed's engines,
before their set-up (a resumed fit) and after it (``trainer.load_checkpoint``). ZeRO keeps
its own fp32 master weights and optimizer partitions, so writing into the module's tensors
alone would be overwritten at the next step, silently."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from tests.support.gates import needs
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = [needs("deepspeed"), pytest.mark.timeout(300)]

#: float32 (DeepSpeed trains float32 only): a checkpoint crossing between fsdp and DeepSpeed,
#: or DeepSpeed's own resumed, against the uninterrupted run; measured 3.0e-8 in every case
#: here (2026-12-03), the same floor as 2 ranks against one process (test_deepspeed.py)
TOL = 1e-5
#: every parameter partitioned at stage 3 (DeepSpeed keeps small ones whole by default)
SMALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def deepspeed(stage: int = 3, checkpoint: str = "full") -> distkit.DeepSpeedStrategy:
    return distkit.DeepSpeedStrategy(stage=stage, config=SMALL, checkpoint=checkpoint)


def _net(optimizer: str = "adam") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    if optimizer == "sgd":
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def fit(
    strategy: Any,
    batch: int,
    folder: str | None,
    *,
    load: str | None = None,
    optimizer: str = "adam",
    **settings: Any,
) -> dict:
    """2 epochs of 64 samples, Adam (or ``optimizer="sgd"``); ``load``: first fit 2 steps
    (other weights, the backend's optimizer state made), load that checkpoint into the set-up
    objects, then fit to the end."""
    trainer = distkit.Trainer(strategy, batch_size=batch, max_epochs=2, seed=11, progress=False,
                              checkpoint_dir=folder, **settings)  # fmt: skip
    net, opt = _net(optimizer)
    data = make_dataset(64)
    if load is not None:
        trainer.max_steps = 2
        trainer.fit(net, opt, data, loss_fn=nn.functional.cross_entropy)
        trainer.load_checkpoint(load)
        trainer.max_steps = settings.get("max_steps")
    trainer.fit(net, opt, data, loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(), "steps": trainer.global_step}
    trainer.close()
    return out


def test_an_fsdp_sharded_checkpoint_resumes_under_deepspeed_before_and_after_setup(
    run_on_ranks, tmp_path
):
    """At stage 3 (stage 2 takes the same path, without the partitioned shapes)."""
    stage = 3
    whole = run_on_ranks(fit, "ddp", 8, None, world_size=1)[0]
    folder = tmp_path / "ckpt"
    sharded = distkit.FSDPStrategy(checkpoint="sharded")
    run_on_ranks(partial(fit, max_steps=5, checkpoint_every=5), sharded, 4, str(folder),
                 world_size=2)  # fmt: skip
    saved = ckpt.CheckpointFolder(folder).latest()
    assert saved is not None and "shards" in ckpt.load(saved)
    resumed = run_on_ranks(partial(fit, resume=str(saved)), deepspeed(stage), 4, None,
                           world_size=2)  # fmt: skip
    loaded = run_on_ranks(partial(fit, load=str(saved)), deepspeed(stage), 4, None, world_size=2)
    for name, runs in (("resumed", resumed), ("loaded after set-up", loaded)):
        for rank in runs:
            assert rank["steps"] == whole["steps"], name
            assert max_abs_diff(rank["state"], whole["state"]) <= TOL, name


def test_a_deepspeed_checkpoint_resumes_under_fsdp_before_and_after_setup(run_on_ranks, tmp_path):
    """deepspeed x2 (stage 3, the full format) -> fsdp x2, by resume= and by load_checkpoint
    into fsdp's sharded parameters (the other way: the test above, sharded)."""
    whole = run_on_ranks(fit, "ddp", 8, None, world_size=1)[0]
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(fit, max_steps=5, checkpoint_every=5), deepspeed(3), 4, str(folder),
                 world_size=2)  # fmt: skip
    saved = ckpt.CheckpointFolder(folder).latest()
    assert saved is not None and "shards" not in ckpt.load(saved)
    resumed = run_on_ranks(partial(fit, resume=str(saved)), "fsdp", 4, None, world_size=2)
    loaded = run_on_ranks(partial(fit, load=str(saved)), "fsdp", 4, None, world_size=2)
    for name, runs in (("resumed", resumed), ("loaded after set-up", loaded)):
        for rank in runs:
            assert rank["steps"] == whole["steps"], name
            assert max_abs_diff(rank["state"], whole["state"]) <= TOL, name


# ------------------------------------------------- DeepSpeedStrategy(checkpoint="sharded")
def _refusal(strategy: Any, path: str, **settings: Any) -> str:
    try:
        fit(strategy, 4, None, resume=path, **settings)
    except distkit.errors.CheckpointError as exc:
        return str(exc)
    return "resumed"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_own_sharded_checkpoint_resumes_exactly_at_its_stage_and_world_size(
    run_on_ranks, tmp_path, stage
):
    """Each rank writes its own partitions (DeepSpeed's save_checkpoint); the file holds no
    weights. Resumed by resume= and by load_checkpoint after a fit, it ends where an
    uninterrupted run ends; anywhere DeepSpeed cannot read it, it is refused up front."""
    whole = run_on_ranks(fit, "ddp", 8, None, world_size=1)[0]
    folder = tmp_path / "ckpt"
    native = deepspeed(stage, checkpoint="sharded")
    run_on_ranks(partial(fit, max_steps=5, checkpoint_every=5), native, 4, str(folder),
                 world_size=2)  # fmt: skip
    saved = ckpt.CheckpointFolder(folder).latest()
    assert saved is not None
    payload = ckpt.load(saved)  # its digests verified every rank's files
    assert all(t.device.type == "meta" for t in payload["model"].values())  # no data
    assert payload["model"]["0.weight"].shape == (16, 6)  # full shapes, even at stage 3
    files = [p.name for p in Path(payload["shards"]).rglob("*") if p.is_file()]
    assert sum("zero_pp_rank_0_" in f for f in files) == sum("zero_pp_rank_1_" in f for f in files)
    assert any("zero_pp_rank_1_" in f for f in files)  # each rank its own partitions
    # DeepSpeed's conversion script is no part of the state: without it the checkpoint still
    # verifies and resumes (below); before, deleting it made the checkpoint "damaged"
    (helper,) = Path(payload["shards"]).rglob("zero_to_fp32.py")
    helper.unlink()
    ckpt.load(saved)
    resumed = run_on_ranks(partial(fit, resume=str(saved)), native, 4, None, world_size=2)
    loaded = run_on_ranks(partial(fit, load=str(saved)), native, 4, None, world_size=2)
    for name, runs in (("resumed", resumed), ("loaded after set-up", loaded)):
        for rank in runs:
            assert rank["steps"] == whole["steps"], name
            assert max_abs_diff(rank["state"], whole["state"]) <= TOL, name
    other_stage = 5 - stage  # 2 <-> 3
    elsewhere = (("ddp", 2), (deepspeed(stage, "sharded"), 1), (deepspeed(other_stage), 2))
    for strategy, world in elsewhere:
        messages = run_on_ranks(_refusal, strategy, str(saved), world_size=world)
        for message in messages:
            assert "DeepSpeed's own sharded state" in message, message
            assert "zero_to_fp32.py" in message and "checkpoint='full'" in message, message
    # another optimizer than the one the partitions hold: refused before DeepSpeed reads them
    sgd = partial(_refusal, optimizer="sgd")
    message = run_on_ranks(sgd, native, str(saved), world_size=2)[0]
    assert "optimizer state of Adam" in message and "SGD" in message, message
    # a damaged partition file (rank 1's) is refused when the checkpoint loads, by name
    victim = next(p for p in Path(payload["shards"]).rglob("*zero_pp_rank_1_*") if p.is_file())
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"damaged shards.*zero_pp_rank_1_"):
        ckpt.load(saved)
