"""Token-exact losses (issue 27, part 1): N processes with batch b and accumulation k train
exactly like one process with batch N*b*k on padded variable-length sequences, for the
Trainer (``step_fn`` returning ``distkit.Loss(total, count)``) and a user's loop
(``rt.backward(total, count=n)``), on every backend; the batch-mean way differs (so the
tests can fail). Real gloo / horovodrun processes."""

from __future__ import annotations

from functools import partial

import pytest

from tests.runtime.test_user_loop_apex import _on_fake_apex
from tests.support.exactness import DTYPE, TOL  # the runs compared train in float64
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.token_workloads import fit_tokens, loop_tokens, reference
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(300)

#: apex trains float32 master weights (so the fake apex runs float32, against a float32
#: reference): 2 ranks against one process measured 1.2e-7 on x86_64, 2026-12-03; the
#: batch-mean way is 1e-3 off, so 1e-5 still tells them apart
APEX_TOL = 1e-5


@pytest.fixture(scope="module")
def exact():
    """What one plain-torch process computes with global batches of 8 (the token mean), in
    float64 as the runs it is compared with."""
    return reference(8, dtype=DTYPE)


@pytest.mark.parametrize("count", ["tensor", "int"])
def test_trainer_at_two_ddp_ranks_with_accumulation_equals_one_process(run_on_ranks, exact, count):
    one = run_on_ranks(partial(fit_tokens, count=count), "ddp", 8, 1, world_size=1)[0]
    assert max_abs_diff(one["state"], exact) <= TOL
    two = run_on_ranks(partial(fit_tokens, count=count), "ddp", 2, 2, world_size=2)
    for rank in two:
        assert max_abs_diff(rank["state"], exact) <= TOL
    # the epoch's train_loss is the token mean over every rank (the same figure as 1 process)
    for a, b in zip(one["history"], two[0]["history"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)


def test_the_batch_mean_way_differs_at_two_ranks(run_on_ranks, exact):
    """The same data with the per-batch token mean (weighted by samples, as a mean loss
    is): N processes no longer equal one, so the exact tests above can fail."""
    two = run_on_ranks(partial(fit_tokens, exact=False), "ddp", 2, 2, world_size=2)
    assert max_abs_diff(two[0]["state"], exact) > 1e-3


def test_a_user_loop_at_two_ddp_ranks_equals_one_process(run_on_ranks, exact):
    for rank in run_on_ranks(loop_tokens, "ddp", 2, 2, world_size=2):
        assert max_abs_diff(rank["state"], exact) <= TOL


def test_fsdp_at_two_ranks_equals_one_process(run_on_ranks, exact):
    for rank in run_on_ranks(fit_tokens, "fsdp", 2, 2, world_size=2):
        assert max_abs_diff(rank["state"], exact) <= TOL
    for rank in run_on_ranks(loop_tokens, "fsdp", 2, 2, world_size=2):
        assert max_abs_diff(rank["state"], exact) <= TOL


def test_dp_in_one_process_equals_one_process(exact):
    assert max_abs_diff(fit_tokens("dp", 4, 2)["state"], exact) <= TOL
    assert max_abs_diff(loop_tokens("dp", 4, 2)["state"], exact) <= TOL


def test_clipping_sees_the_normalised_gradients(run_on_ranks):
    """Clipped after the division by the count: 2 ranks equal 1 process, and the clip acts."""
    one = run_on_ranks(partial(fit_tokens, gradient_clip_norm=0.05), "ddp", 8, 1, world_size=1)
    two = run_on_ranks(partial(fit_tokens, gradient_clip_norm=0.05), "ddp", 2, 2, world_size=2)
    assert max_abs_diff(two[0]["state"], one[0]["state"]) <= TOL
    assert max_abs_diff(one[0]["state"], reference(8, dtype=DTYPE)) > 1e-3


@needs("horovod")
def test_horovod_at_two_ranks_equals_one_process(tmp_path, exact):
    calls = [
        ("tests.support.token_workloads", "fit_tokens", ("horovod", 2, 2), {}),
        ("tests.support.token_workloads", "loop_tokens", ("horovod", 2, 2), {}),
    ]
    for fit, loop in run_with_horovodrun(calls, tmp_path):
        assert max_abs_diff(fit["state"], exact) <= TOL
        assert max_abs_diff(loop["state"], exact) <= TOL


@pytest.mark.filterwarnings("ignore:distkit apex:UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["legacy", "modern"])
def test_apex_at_two_ranks_equals_one_process(run_on_ranks, exact, kind):
    """FAKE apex packages and FAKE CUDA (tests/support/fakes; apex is CUDA-only): legacy
    amp's master gradients and apex's DDP, and modern apex (torch amp), on real gloo ranks."""
    exact32 = reference(8)  # float32
    for loop in (fit_tokens, loop_tokens):
        for rank in run_on_ranks(_on_fake_apex, kind, loop, "apex", 2, 2, world_size=2):
            assert max_abs_diff(rank["state"], exact32) <= APEX_TOL


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_at_two_ranks_equals_one_process(run_on_ranks, precision):
    """The same autocast and (fp16) loss scale at any world size (the scale of a total keeps
    the gradients those of a per-sample mean: no step skipped): equal up to the rounding of
    16-bit matmuls over batches of other sizes, far closer than the batch-mean way."""
    fit = partial(fit_tokens, precision=precision)
    one = run_on_ranks(fit, "ddp", 8, 1, world_size=1)[0]
    two = run_on_ranks(fit, "ddp", 2, 2, world_size=2)[0]
    mean = run_on_ranks(partial(fit, exact=False), "ddp", 2, 2, world_size=2)[0]
    rounding = max_abs_diff(two["state"], one["state"])
    assert rounding <= 5e-3
    assert max_abs_diff(mean["state"], one["state"]) > 5 * rounding
    assert [h["skipped_steps"] for h in two["history"]] == [0, 0]
