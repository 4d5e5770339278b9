"""Tensor parallel inside FSDP (issue 47): ``FSDPStrategy(tensor_parallel=T, tensor_plan=...)``
on the mesh ``(replicate, shard, tensor)``. Every layout that fits 4 gloo ranks with T=2
against one process at the same global batch (accumulation, an uneven last step, clipping
over the DTensor shards), through the Trainer, in float64."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.support.exactness import DTYPE, TOL  # the runs compared train in float64
from tests.support.workloads import make_dataset, make_stack, max_abs_diff

pytestmark = pytest.mark.timeout(400)

N = 21  # global batches of 8 with 2 accumulated: 16 + 5 (an uneven last step)
PLAN = {"layers.*.inner": "colwise", "layers.*.outer": "rowwise"}


def fit(
    name: str,
    batch: int,
    replicate: int = 1,
    tensor: int = 1,
    clip: float | None = None,
    **settings: Any,
) -> dict[str, Any]:
    torch.manual_seed(0)
    if name == "fsdp":
        plan = PLAN if tensor > 1 else None
        strategy: Any = distkit.FSDPStrategy(
            replicate=replicate, tensor_parallel=tensor, tensor_plan=plan
        )
    else:
        strategy = name
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, gradient_clip_norm=clip,
                              **settings)  # fmt: skip
    model = make_stack(dtype=DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = make_dataset(N, dtype=DTYPE)
    result = trainer.fit(model, optimizer, data, val_data=data, loss_fn=nn.functional.cross_entropy)
    inner = model.layers[0].inner.weight
    out = {
        "state": trainer.full_state_dict(),
        "steps": trainer.global_step,
        "history": result.history,
        "mesh": getattr(getattr(inner, "device_mesh", None), "mesh_dim_names", None),
        "local": tuple(inner.to_local().shape) if hasattr(inner, "to_local") else None,
        "data": (trainer.runtime.data_rank, trainer.runtime.data_world_size),
    }
    trainer.close()
    return out


def _same_epochs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for mine, theirs in zip(a, b, strict=True):
        for key in ("train_loss", "val_loss"):
            assert abs(mine[key] - theirs[key]) <= TOL, (key, mine[key], theirs[key])


@pytest.mark.parametrize(
    ("replicate", "world", "mesh"),
    [(1, 2, ("tensor",)), (1, 4, ("shard", "tensor")), (2, 4, ("replicate", "shard", "tensor"))],
    ids=["tp2", "fsdp2xtp2", "hsdp2x1xtp2"],
)
def test_tensor_parallel_equals_one_process_at_the_global_batch(
    run_on_ranks, replicate, world, mesh
):
    """T=2 at every layout of 2 and 4 ranks: the T ranks of a group see the same samples,
    so the global batch is 4 x (world / 2); clipping's norm is over every shard once."""
    shares = world // 2
    one = run_on_ranks(partial(fit, clip=0.05), "ddp", 4 * shares, world_size=1)[0]
    ranks = run_on_ranks(
        partial(fit, replicate=replicate, tensor=2, clip=0.05), "fsdp", 4, world_size=world
    )
    for rank, result in enumerate(ranks):
        assert result["data"] == (rank // 2, shares)
        assert result["steps"] == one["steps"]
        # the colwise layer's 16 rows: split over 2 by TP, then over the shard dimension
        assert result["local"][0] == 16 // 2 // (shares // replicate)
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        _same_epochs(result["history"], one["history"])
    if mesh[0] == "tensor":
        assert ranks[0]["mesh"] == ("tensor",)
    else:  # FSDP over the data-parallel dimensions, TP inside: 2-D parameters
        assert ranks[0]["mesh"] is not None and "tensor" in ranks[0]["mesh"]
