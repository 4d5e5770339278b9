"""A user's own loop on distkit.Runtime, used wrongly: each misuse fails at once with an error
that names it and the fix; and the loader's epochs, lengths and resumable position."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import TrainerClosedError
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(120)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _set_up(rt: distkit.Runtime):
    model = make_mlp()
    return rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_backward_before_setup_is_refused():
    with distkit.Runtime("dp") as rt:
        model = make_mlp()
        x, y = make_dataset(4).tensors
        with pytest.raises(
            distkit.ConfigurationError, match=r"rt\.backward\(loss\) before rt\.setup"
        ):
            rt.backward(_loss(model(x), y))


def test_a_model_set_up_twice_or_again_is_refused():
    with distkit.Runtime("dp") as rt:
        model = make_mlp()
        set_up, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(distkit.ConfigurationError, match="set up already"):
            rt.setup(model)
        with pytest.raises(distkit.ConfigurationError, match=r"what rt\.setup returned"):
            rt.setup(set_up)


@pytest.mark.parametrize(
    ("optimizers", "message"),
    [
        (lambda m: ["sgd"], r"optimizer #1 must be a torch\.optim\.Optimizer, got str"),
        (lambda m: [torch.optim.SGD(make_mlp().parameters(), lr=1)], "not parameters of the model"),
    ],
)
def test_setup_refuses_optimizers_that_are_not_the_models(optimizers, message):
    with distkit.Runtime("dp") as rt:
        model = make_mlp()
        with pytest.raises(distkit.ConfigurationError, match=message):
            rt.setup(model, *optimizers(model))
        with pytest.raises(distkit.ConfigurationError, match=r"must be a torch\.nn\.Module"):
            rt.setup("model")  # type: ignore[arg-type]


def test_accumulation_needs_the_loaders_batches():
    with distkit.Runtime("dp", grad_accum_steps=2) as rt:
        model, _ = _set_up(rt)
        x, y = make_dataset(4).tensors
        with pytest.raises(
            distkit.ConfigurationError, match=r"grad_accum_steps=2 needs the batches of"
        ):
            rt.backward(_loss(model(x), y))
        for x, y in rt.loader(make_dataset(8), batch_size=4):
            rt.backward(_loss(model(x), y))  # inside the loader: fine


def test_clip_gradients_takes_the_set_up_optimizer_and_a_limit():
    with distkit.Runtime("dp") as rt:
        model, optimizer = _set_up(rt)
        with pytest.raises(
            distkit.ConfigurationError, match=r"takes the optimizer rt\.setup returned"
        ):
            rt.clip_gradients(model, optimizer.optimizer, max_norm=1.0)
        with pytest.raises(distkit.ConfigurationError, match="needs max_norm"):
            rt.clip_gradients(model, optimizer)
        with pytest.raises(distkit.ConfigurationError, match="max_norm"):
            rt.clip_gradients(model, optimizer, max_norm=-1.0)


def test_a_closed_runtime_refuses_the_loop():
    rt = distkit.Runtime("dp")
    model, _ = _set_up(rt)
    rt.close()
    for call in (
        lambda: rt.loader(make_dataset(4)),
        lambda: rt.setup(make_mlp()),
        lambda: rt.backward(model(make_dataset(2).tensors[0]).sum()),
    ):
        with pytest.raises(TrainerClosedError, match="on a closed Runtime"):
            call()


def test_the_loader_gives_epoch_after_epoch_and_resumes_where_it_was():
    with distkit.Runtime("dp", seed=1) as rt:
        loader = rt.loader(make_dataset(10), batch_size=4, shuffle=True)
        assert len(loader) == 3 and loader.current_epoch == 0
        first = [y.tolist() for _, y in loader]
        second = [y.tolist() for _, y in loader]
        assert loader.current_epoch == 2 and first != second  # each epoch its own order
        flat_first = [label for batch in first for label in batch]
        flat_second = [label for batch in second for label in batch]
        assert sorted(flat_first) == sorted(flat_second) and len(flat_first) == 10
        again = [y.tolist() for _, y in loader.epoch(1)]
        assert again == second  # an epoch's order depends on the seed and the epoch alone
        # stop after one batch of epoch 0, save, then resume in another loader
        part = loader.epoch(0)
        for _ in part:
            break
        state = loader.state_dict()
        assert state == {"epoch": 0, "position": 4}
        other = rt.loader(make_dataset(10), batch_size=4, shuffle=True)
        other.load_state_dict(state)
        assert [y.tolist() for _, y in other] == first[1:]
        with pytest.raises(distkit.ConfigurationError, match="epoch must be an integer >= 0"):
            loader.epoch(-1)
        with pytest.raises(distkit.ConfigurationError, match="expected an integer >= 0"):
            other.load_state_dict({"epoch": 0, "position": "4"})


def test_a_loader_iterated_inside_its_own_loop_is_refused():
    with distkit.Runtime("dp") as rt:
        loader = rt.loader(make_dataset(8), batch_size=4)
        with pytest.raises(distkit.ConfigurationError, match="already being iterated"):
            for _ in loader:
                for _ in loader:
                    pass


def test_mid_window_steps_and_zero_grads_wait_for_the_window_to_end():
    """grad_accum_steps=2: the first micro-batch's step() and zero_grad() do nothing (its
    gradients stay and add up); the second's step on the sum, then clear."""
    with distkit.Runtime("dp", grad_accum_steps=2) as rt:
        model, optimizer = _set_up(rt)
        before = [p.detach().clone() for p in model.parameters()]
        grads = []
        for x, y in rt.loader(make_dataset(8), batch_size=2, shuffle=False):
            rt.backward(_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            grads.append(next(model.parameters()).grad)
            if len(grads) == 1:
                assert all(
                    torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
                )
                assert grads[0] is not None  # kept for the next micro-batch
        assert grads[1] is None  # cleared at the window's end
        assert optimizer.last_outcome is not None and optimizer.last_outcome.stepped


def _train_dp(per_replica: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    with distkit.Runtime("dp") as rt:
        model, optimizer = _set_up(rt)
        for x, y in rt.loader(make_dataset(8), batch_size=4, shuffle=False):
            loss = _loss(model(x), y)
            rt.backward(loss.reshape(1) if per_replica else loss)  # one replica on the CPU
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]


def test_a_per_replica_loss_is_reduced_by_the_batch_it_came_from():
    """dp gathers one loss per replica when the loss is computed inside the model: backward
    weights it by the replicas' shares of the loader's batch, as the Trainer does (it was
    divided by a batch of 0: a NaN step)."""
    scalar, per_replica = _train_dp(False), _train_dp(True)
    assert all(torch.isfinite(p).all() for p in per_replica)
    assert all(torch.equal(a, b) for a, b in zip(scalar, per_replica, strict=True))


def test_a_per_replica_loss_outside_the_loader_is_refused():
    with distkit.Runtime("dp") as rt:
        model, _ = _set_up(rt)
        x, y = make_dataset(4).tensors
        with pytest.raises(distkit.ConfigurationError, match=r"a loss of shape \(1,\) outside"):
            rt.backward(_loss(model(x), y).reshape(1))


def test_a_step_on_gradients_of_a_direct_loss_backward_is_refused():
    """loss.backward() skips rt.backward's weight (and fp16's scale): the step on those
    gradients is refused at every world size, naming rt.backward; after rt.backward the
    same loop steps."""
    with distkit.Runtime("dp") as rt:
        model, optimizer = _set_up(rt)
        x, y = make_dataset(8).tensors
        _loss(model(x), y).backward()
        with pytest.raises(distkit.ConfigurationError, match=r"call rt\.backward\(loss\)"):
            optimizer.step()
        optimizer.zero_grad()
        optimizer.step()  # no gradients at all: nothing to refuse (torch skips them too)
        for _ in range(2):
            rt.backward(_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        _loss(model(x), y).backward()  # again, after steps that were right
        with pytest.raises(distkit.ConfigurationError, match="did not make"):
            optimizer.step()
