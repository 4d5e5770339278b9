"""FSDP2's own policies through FSDPStrategy (issue 28, part 3): a user MixedPrecisionPolicy,
and CPUOffloadPolicy run on this CPU machine."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

import distkit
from tests.support.exactness import DTYPE, TOL
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)

BF16 = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
)


def fit(
    strategy: Any, batch: int, precision: str = "32", dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, precision=precision)  # fmt: skip
    model = make_mlp(dtype=dtype)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                make_dataset(21, dtype=dtype), loss_fn=nn.functional.cross_entropy)  # fmt: skip
    out = {"state": trainer.full_state_dict()}
    trainer.close()
    return out


def offloaded() -> distkit.Strategy:
    return distkit.FSDPStrategy(offload_policy=CPUOffloadPolicy(pin_memory=False))


def test_cpu_offload_trains_like_one_process(run_on_ranks):
    """On a CPU machine the parameters are on the CPU already: what this runs is FSDP2's
    offload path itself (its optimizer step on the offloaded shards, the copies to and from
    the compute device), at two ranks, against one process at twice the batch, in float64."""
    one = run_on_ranks(partial(fit, dtype=DTYPE), "ddp", 8, world_size=1)[0]
    two = run_on_ranks(partial(fit, batch=4, dtype=DTYPE), offloaded(), world_size=2)
    for rank in two:
        assert max_abs_diff(rank["state"], one["state"]) <= TOL


def test_a_user_mixed_precision_policy_is_the_one_applied(run_on_ranks):
    """The user's bf16 policy equals distkit's own bf16 policy (the same MixedPrecisionPolicy
    distkit derives from precision='bf16'), and differs from fp32 by bf16 rounding."""
    own = distkit.FSDPStrategy(mp_policy=BF16)
    theirs = run_on_ranks(partial(fit, batch=4), own, world_size=2)
    derived = run_on_ranks(partial(fit, batch=4, precision="bf16"), "fsdp", world_size=2)
    full = run_on_ranks(partial(fit, batch=4), "fsdp", world_size=2)
    for a, b, c in zip(theirs, derived, full, strict=True):
        # one policy, applied by the same code: bitwise (measured 0.0)
        assert max_abs_diff(a["state"], b["state"]) == 0.0
        assert 1e-5 < max_abs_diff(a["state"], c["state"]) <= 5e-2


def test_a_policy_and_a_precision_together_are_refused_leaving_no_group_behind():
    """The refusal comes after the process group is up: it is released with the error (it
    outlived it, and a corrected retry in the same process found it still there), so the
    retry starts clean and ends clean."""
    with pytest.raises(distkit.ConfigurationError, match="both set the mixed precision"):
        distkit.Trainer(distkit.FSDPStrategy(mp_policy=BF16), precision="bf16")
    assert not torch.distributed.is_initialized()
    retry = distkit.Trainer(distkit.FSDPStrategy(mp_policy=BF16), precision="32")
    assert torch.distributed.is_initialized()
    retry.close()
    assert not torch.distributed.is_initialized()


def test_an_fp16_policy_is_refused_naming_the_way_that_scales():
    with pytest.raises(distkit.ConfigurationError, match="loss scaler"):
        distkit.FSDPStrategy(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
