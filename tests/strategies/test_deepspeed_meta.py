"""A model built on the meta device under DeepSpeed ZeRO stage 3 (issue 28, part 2): each
module is given the normal build's initial values and partitioned at once, so no rank holds
the whole model; the result equals the same model built normally after the same seed.
Stages 1 and 2 keep the whole model on every rank: they refuse it, naming stage 3."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.support.gates import needs
from tests.support.meta_models import build, fit_on_meta
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = [needs("deepspeed"), pytest.mark.timeout(300)]

#: every parameter partitioned (DeepSpeed keeps parameters under 1e5 elements whole by default)
SMALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _stage(stage: int = 3) -> distkit.DeepSpeedStrategy:
    return distkit.DeepSpeedStrategy(stage=stage, config=SMALL)


def initial(meta: str) -> dict[str, Any]:
    """The weights right after the set-up, and how much of them this rank holds."""
    with distkit.Runtime(_stage(), seed=0) as rt:
        model = build(meta)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, _ = rt.setup(model, optimizer)
        held = sum(p.ds_tensor.numel() for p in model.parameters())
        total = sum(p.ds_numel for p in model.parameters())
        return {"state": rt.full_state_dict(engine), "held": held, "total": total}


@pytest.mark.parametrize("world", [1, 2])
def test_a_meta_model_under_stage_3_gets_the_normal_builds_initial_values(run_on_ranks, world):
    """Bitwise, in a world of one and of two; at two each rank holds about half."""
    normal = run_on_ranks(initial, "normal", world_size=world)
    built = run_on_ranks(initial, "torch", world_size=world)
    for a, b in zip(normal, built, strict=True):
        assert a["state"].keys() == b["state"].keys()
        same = all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
        assert same, max_abs_diff(a["state"], b["state"])
        assert b["held"] == a["held"] <= b["total"] // world + 8 * world  # padding at most


def fit(meta: str, *, precision: str = "32", **settings: Any) -> dict[str, Any]:
    # DeepSpeed's bf16 keeps BatchNorm's running statistics in fp32, which CPU autocast's
    # batch_norm refuses (a normally built model as much): bf16 runs without BatchNorm
    model = build(meta, batch_norm=precision == "32")
    trainer = distkit.Trainer(_stage(), batch_size=4, grad_accum_steps=2, seed=3, max_epochs=2,
                              progress=False, precision=precision, **settings)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer.fit(model, optimizer, make_dataset(21), loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(), "steps": trainer.global_step}
    trainer.close()
    return out


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_a_meta_model_under_stage_3_x2_trains_like_the_normally_built_one(run_on_ranks, precision):
    """(BatchNorm keeps per-rank statistics, so both differ from one process at 2x the
    batch: what must match is the two builds.)"""
    normal = run_on_ranks(partial(fit, precision=precision), "normal", world_size=2)
    built = run_on_ranks(partial(fit, precision=precision), "init_empty", world_size=2)
    for a, b in zip(normal, built, strict=True):
        assert b["steps"] == a["steps"] > 0
        # the same arithmetic in the same order from bitwise-equal weights: equal bitwise
        # (DeepSpeed trains float32 only, so this is no float64 comparison; measured 0.0)
        assert max_abs_diff(b["state"], a["state"]) == 0.0


def test_a_meta_model_under_stage_3_resumes_from_a_checkpoint(run_on_ranks, tmp_path):
    """The checkpoint is loaded before the set-up into a model with no values: it waits for
    the partitioning (else training would restart from the initial weights, silently)."""
    whole = run_on_ranks(fit, "normal", world_size=2)
    folder = str(tmp_path / "ckpt")
    run_on_ranks(partial(fit, checkpoint_dir=folder, max_steps=3), "normal", world_size=2)
    resumed = run_on_ranks(partial(fit, checkpoint_dir=folder, resume="auto"), "init_empty",
                           world_size=2)  # fmt: skip
    # resumed exactly: the same steps as the uninterrupted run, bitwise (measured 0.0)
    assert max_abs_diff(resumed[0]["state"], whole[0]["state"]) == 0.0
    for a, b in zip(whole, resumed, strict=True):  # BatchNorm's statistics: each rank's own,
        assert b["steps"] == a["steps"]  # the checkpoint holds rank 0's
        weights = [k for k in a["state"] if "running" not in k and "num_batches" not in k]
        assert max_abs_diff({k: b["state"][k] for k in weights},
                            {k: a["state"][k] for k in weights}) == 0.0  # fmt: skip


def test_a_meta_model_under_stages_1_and_2_is_refused_naming_stage_3(run_on_ranks):
    (message,) = run_on_ranks(fit_on_meta, _stage(2), world_size=1)
    assert "meta device" in message and "DeepSpeedStrategy(stage=3)" in message, message
