"""Token-exact losses under hostile input: counts of zero (one rank's, or every rank's),
mixed windows, bad totals and counts, and models that return their own loss."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch

import distkit
from distkit.errors import ConfigurationError
from tests.support.exactness import DTYPE, TOL
from tests.support.token_workloads import (
    Sequences,
    fit_tokens,
    loop_tokens,
    make_lm,
    reference,
    token_sum,
)
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(300)


def error_of(fn, *args):
    """The message of the ConfigurationError ``fn(*args)`` raises on this rank."""
    try:
        fn(*args)
    except ConfigurationError as exc:
        return str(exc)
    raise AssertionError("no error")


def test_a_rank_whose_micro_batches_have_no_items_contributes_nothing(run_on_ranks):
    """The odd samples have no labels: with shuffle=False rank 1 holds only those. It still
    joins every all-reduce (no hang) and adds nothing: both ranks end where one process
    ends on the same data."""
    exact = reference(4, empty="odd", dtype=DTYPE)  # float64, as the runs it is compared with
    for rank in run_on_ranks(partial(loop_tokens, empty="odd"), "ddp", 2, 1, world_size=2):
        assert max_abs_diff(rank["state"], exact) <= TOL
    for rank in run_on_ranks(partial(fit_tokens, empty="odd"), "ddp", 2, 1, world_size=2):
        assert max_abs_diff(rank["state"], exact) <= TOL


def test_zero_items_on_every_rank_is_refused_at_that_step_with_int_counts(run_on_ranks):
    """Counts given as ints: the step's global count is known on the host (one host-side
    sum), so the first step over no items raises on every rank, before it steps."""
    fit = partial(fit_tokens, count="int", empty="all")
    for error in run_on_ranks(partial(error_of, fit), "ddp", 2, 1, world_size=2):
        assert "0 items on every rank" in error
    with pytest.raises(ConfigurationError, match="0 items on every rank"):
        loop_tokens("dp", 2, 1, count="int", empty="all")


def test_zero_items_on_every_rank_with_device_counts_is_refused_at_the_check_point():
    """Counts given as tensors stay on the device: the step applies zero gradients and the
    next check point (the Trainer's log point or epoch end, a loader epoch's end) raises."""
    with pytest.raises(ConfigurationError, match=r"optimizer steps had a count of 0 items"):
        fit_tokens("dp", 2, 1, empty="all")
    with pytest.raises(ConfigurationError, match=r"found at this check point|Found at this"):
        loop_tokens("dp", 2, 1, empty="all")


def test_a_negative_tensor_count_is_refused_at_the_check_point_naming_it():
    """A sign slip (-(labels != -100).sum()) kept on the device: no step may train on it
    (before, the step's factor was 0 and the run went on, rc 0, the weights never moving).
    The next check point raises, naming the count."""
    for run in (fit_tokens, loop_tokens):
        with pytest.raises(ConfigurationError, match=r">= 0.*lowest was -\d+") as caught:
            run("dp", 2, 1, count="negative")
        assert "(labels != -100).sum()" in str(caught.value)


def test_a_negative_count_on_one_rank_is_refused_on_every_rank(run_on_ranks):
    """Rank 1 alone slips: both ranks raise at the same check point (no hang), and each
    says whose count it was. The other rank's positive counts must not hide it in the sum."""
    for run in (fit_tokens, loop_tokens):
        fit = partial(run, count="negative-on-rank-1")
        errors = run_on_ranks(partial(error_of, fit), "ddp", 2, 1, world_size=2)
        assert "another rank's were" in errors[0]
        assert re.search(r"this rank's lowest was -\d+", errors[1])


def test_a_window_that_mixes_token_and_mean_losses_is_refused():
    with distkit.Runtime("dp", grad_accum_steps=2) as rt:
        model = make_lm()
        model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        batches = iter(rt.loader(Sequences(), batch_size=2, shuffle=False))
        total, n = token_sum(model, next(batches))
        rt.backward(total, count=n)
        total, n = token_sum(model, next(batches))
        with pytest.raises(ConfigurationError, match="mixes token-exact losses"):
            rt.backward(total / n)


@pytest.mark.parametrize(
    ("total", "count", "match"),
    [
        (1.5, 3, "must be a tensor"),
        (torch.tensor(3), 3, "floating-point"),
        (torch.ones(2, 2), 3, "must be a scalar"),
        (torch.tensor(2.0), -1, ">= 0"),
        (torch.tensor(2.0), 2.5, "int or an integer tensor"),
        (torch.tensor(2.0), True, "got a bool"),
        (torch.tensor(2.0), torch.tensor(2.5), "integer tensor"),
        (torch.tensor(2.0), torch.ones(2, 2, dtype=torch.long), "scalar count"),
    ],
)
def test_bad_totals_and_counts_are_refused_naming_the_fix(total, count, match):
    with pytest.raises(ConfigurationError, match=match):
        distkit.Loss(total, count)
    with distkit.Runtime("dp") as rt:
        model = make_lm()
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ConfigurationError, match=match):
            rt.backward(total, count=count)


def test_a_total_that_does_not_reach_the_model_is_refused():
    trainer = distkit.Trainer("dp", batch_size=2, max_epochs=1, progress=False)
    model = make_lm()
    with pytest.raises(ConfigurationError, match="does not require grad"):
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), Sequences(),
                    step_fn=lambda m, b: distkit.Loss(torch.tensor(1.0), 3))  # fmt: skip
    trainer.close()


class OwnLoss(torch.nn.Module):
    """A model that computes its own (mean) loss, as a Hugging Face model does."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.lm = make_lm()
        self.as_dict = as_dict

    def forward(self, input_ids, labels):
        total, n = token_sum(self.lm, {"input_ids": input_ids, "labels": labels})
        out = {"loss": total / n.clamp(min=1), "logits": None}
        if self.as_dict:
            return out
        return type("Output", (), out)()


@pytest.mark.parametrize("as_dict", [True, False])
def test_a_model_returning_its_own_loss_trains_from_its_output(as_dict):
    """step_fn may return the model's output: its .loss / ["loss"] is the batch mean."""
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=1, progress=False, shuffle=False)
    model = OwnLoss(as_dict)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), Sequences(),
                step_fn=lambda m, b: m(**b))  # fmt: skip
    assert max_abs_diff(model.state_dict(), before) > 1e-3
    assert trainer.close() is None


def disagreeing_fit(strategy: str) -> str:
    """Rank 1 returns the batch-mean loss where rank 0 returns distkit.Loss."""
    import torch.distributed as dist

    trainer = distkit.Trainer(strategy, batch_size=2, max_epochs=1, progress=False)
    model = make_lm()

    def step(m, b):
        total, n = token_sum(m, b)
        return distkit.Loss(total, n) if dist.get_rank() == 0 else total / n.clamp(min=1)

    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), Sequences(),
                    step_fn=step)  # fmt: skip
    except ConfigurationError as exc:
        return str(exc)
    finally:
        trainer.close()
    raise AssertionError("no error")


def test_ranks_that_disagree_on_the_kind_of_loss_fail_at_the_first_step(run_on_ranks):
    for message in run_on_ranks(disagreeing_fit, "ddp", world_size=2):
        assert "ranks disagree on the kind of loss" in message
        assert "1 of 2 gave token-exact losses" in message


def test_counts_agreed_as_ints_then_given_as_a_tensor_are_refused():
    """The first step's counts were ints (summed on the host from then on): a tensor count
    later would need a device read; refused, naming the fix."""
    with distkit.Runtime("dp") as rt:
        model = make_lm()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        batches = iter(rt.loader(Sequences(), batch_size=4, shuffle=False))
        total, n = token_sum(model, next(batches))
        rt.backward(total, count=int(n))
        optimizer.step()
        optimizer.zero_grad()
        total, n = token_sum(model, next(batches))
        rt.backward(total, count=n)
        with pytest.raises(ConfigurationError, match="agreed at this optimizer's first step"):
            optimizer.step()


def test_int_counts_after_tensor_counts_are_added_on_the_device():
    """The other way round is fine: an int joins the device count."""
    results = []
    for kinds in (("tensor", "tensor"), ("tensor", "int")):
        with distkit.Runtime("dp") as rt:
            model = make_lm()
            model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
            for kind, batch in zip(kinds, rt.loader(Sequences(), batch_size=4, shuffle=False),
                                   strict=False):  # fmt: skip
                total, n = token_sum(model, batch)
                rt.backward(total, count=n if kind == "tensor" else int(n))
                optimizer.step()
                optimizer.zero_grad()
            results.append(rt.full_state_dict(model))
    assert max_abs_diff(results[0], results[1]) == 0


def test_a_plugin_whose_step_takes_no_before_step_is_refused_naming_the_fix():
    """The division by the count runs from the step's before_step: a plugin step written
    before the keyword existed cannot run it, and says so (mean losses keep working)."""
    from tests.callbacks.test_before_optimizer_step import OldStepPlugin

    with pytest.raises(ConfigurationError, match=r"OldStepPlugin\.step.*takes no before_step"):
        fit_tokens(OldStepPlugin(), 4, 1, epochs=1)
    fit_tokens(OldStepPlugin(), 4, 1, epochs=1, exact=False)
