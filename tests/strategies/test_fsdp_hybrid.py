"""FSDP2's hybrid sharding, ``FSDPStrategy(replicate=R)`` (issue 28, part 3): R replica groups,
each sharding the model over its ranks. HSDP 2x2 on 4 gloo ranks against one process at 4x
the batch, its clipping, its checkpoints into plain fsdp, and the refusals."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import ConfigurationError, RankDisagreementError
from tests.support.exactness import DTYPE, TOL  # the runs compared train in float64
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(400)

N = 21  # global batches of 8 with 2 accumulated: 16 + 5 (an uneven last step)


def fit(
    name: str, batch: int, replicate: int = 1, clip: float | None = None, **settings: Any
) -> dict[str, Any]:
    torch.manual_seed(0)
    strategy = distkit.FSDPStrategy(replicate=replicate) if name == "fsdp" else name
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, gradient_clip_norm=clip,
                              **settings)  # fmt: skip
    model = make_mlp(dtype=DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    taken = []  # the optimizer steps this fit takes (a resumed one: the rest only)
    optimizer.register_step_post_hook(lambda *_: taken.append(1))
    trainer.fit(model, optimizer, make_dataset(N, dtype=DTYPE), loss_fn=nn.functional.cross_entropy)
    first = next(model.parameters())
    local = first.to_local() if hasattr(first, "to_local") else first
    out = {
        "state": trainer.full_state_dict(),
        "steps": trainer.global_step,
        "taken": len(taken),
        "mesh": getattr(getattr(first, "device_mesh", None), "shape", None),
        "local_rows": local.shape[0],
    }
    trainer.close()
    return out


def test_hsdp_2x2_equals_one_process_at_four_times_the_batch_with_clipping(run_on_ranks):
    """4 ranks as 2 replica groups of 2: each parameter is sharded over 2 ranks (not 4), and
    the training equals one process with the global batch, the clip's norm included."""
    one = run_on_ranks(partial(fit, clip=0.05), "ddp", 4, world_size=1)[0]
    four = run_on_ranks(partial(fit, replicate=2, clip=0.05), "fsdp", 1, world_size=4)
    unclipped = run_on_ranks(fit, "ddp", 4, world_size=1)[0]
    assert max_abs_diff(unclipped["state"], one["state"]) > 1e-3  # the clip acts
    for rank in four:
        assert rank["mesh"] == (2, 2)
        assert rank["local_rows"] == 8  # make_mlp's first layer has 16 rows: half each
        assert max_abs_diff(rank["state"], one["state"]) <= TOL


def test_hsdp_checkpoint_resumes_under_plain_fsdp(run_on_ranks, tmp_path):
    whole = run_on_ranks(fit, "ddp", 4, world_size=1)[0]
    folder = str(tmp_path / "ckpt")
    run_on_ranks(partial(fit, replicate=2, checkpoint_dir=folder, max_steps=3), "fsdp", 1,
                 world_size=4)  # fmt: skip
    resumed = run_on_ranks(partial(fit, checkpoint_dir=folder, resume="auto"), "fsdp", 2,
                           world_size=2)  # fmt: skip
    for rank in resumed:
        assert rank["steps"] == whole["steps"]
        assert rank["taken"] == whole["steps"] - 3  # it resumed (a fresh fit ends alike)
        assert max_abs_diff(rank["state"], whole["state"]) <= TOL


def _start(replicate: int) -> BaseException | None:
    try:
        distkit.Trainer(distkit.FSDPStrategy(replicate=replicate), progress=False).close()
    except Exception as exc:  # returned to the test
        return exc
    return None


def test_hsdp_needs_a_world_size_replicate_divides(run_on_ranks):
    for error in run_on_ranks(_start, 3, world_size=2):
        assert isinstance(error, ConfigurationError) and "has 2 ranks" in str(error), error


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_hsdp_replicate_must_be_a_positive_int(value):
    with pytest.raises(ConfigurationError, match="replicate"):
        distkit.FSDPStrategy(replicate=value)


def _start_with_rank_dependent_replicate() -> str:
    rank = int(os.environ["RANK"])
    try:
        distkit.Trainer(distkit.FSDPStrategy(replicate=1 + rank), progress=False).close()
    except RankDisagreementError as exc:
        return str(exc)
    return "started"


def test_ranks_that_disagree_on_replicate_fail_before_building_the_mesh(run_on_ranks):
    """Building a mesh is a collective whose groups every rank must make alike: ranks with
    different replicate values are stopped before it, on every rank, saying what differs."""
    for message in run_on_ranks(_start_with_rank_dependent_replicate, world_size=2):
        assert "replicate" in message and "[1, 2]" in message, message
