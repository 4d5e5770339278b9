"""A DDP model whose loss does not reach some of its parameters (issue 44, item 6): torch's DDP
then steps on the rank's own gradients once and fails at the next forward with an error that
names DDP's keyword. distkit stops at that first backward, before any step, naming the
parameters and the argument of whatever runs the loop: ``distkit.Runtime(...,
find_unused_parameters=True)`` in a user's loop, ``distkit.Trainer(...)`` in a fit. With the
argument, the same loop trains like one process; a model no backward reached yet (a GAN's
generator during the discriminator's step) is not taken for one. Real gloo processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import ConfigurationError
from tests.support import exactness
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = pytest.mark.timeout(300)


class TwoHeads(nn.Module):
    """A multi-task model trained on one task: ``edge`` takes no part in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.seg = nn.Linear(8, 3)
        self.edge = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seg(torch.tanh(self.body(x)))


def user_loop(find_unused: bool) -> dict[str, Any]:
    data = make_dataset(20, dtype=exactness.DTYPE)
    with distkit.Runtime("ddp", seed=4, find_unused_parameters=find_unused) as rt:
        model = TwoHeads().to(exactness.DTYPE)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = rt.setup(model, optimizer)
        try:
            for x, y in rt.loader(data, batch_size=8 // rt.world_size):
                rt.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        except ConfigurationError as error:
            # nothing stepped: the weights are the ones set up
            return {"error": str(error), "moved": max_abs_diff(model.module.state_dict(), before)}
        return {"error": None, "state": rt.full_state_dict(model)}


def trainer_fit() -> str:
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=1, seed=4)
    model = TwoHeads()
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16),
                    nn.functional.cross_entropy)  # fmt: skip
    except ConfigurationError as error:
        return str(error)
    return "no error"


def gan_like() -> str:
    """Two DDP models; the first backward (the critic's) reaches the critic only."""
    with distkit.Runtime("ddp", seed=1) as rt:
        gen, critic = nn.Linear(4, 6), nn.Linear(6, 1)
        gen, opt_g = rt.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
        critic, opt_c = rt.setup(critic, torch.optim.SGD(critic.parameters(), lr=0.1))
        for step in range(2):
            noise = torch.Generator().manual_seed(10 * step + rt.rank)  # each rank its own
            fake = gen(torch.randn(3, 4, generator=noise))
            rt.backward(critic(fake.detach()).mean(), optimizer=opt_c)
            opt_c.step()
            opt_c.zero_grad()
            rt.backward(-critic(fake).mean(), optimizer=opt_g)
            opt_g.step()
            opt_g.zero_grad()
            opt_c.zero_grad()
    return "trained"


def test_an_unused_head_stops_the_first_backward_naming_the_runtimes_argument(run_on_ranks):
    for rank in run_on_ranks(user_loop, False, world_size=2):
        error = rank["error"]
        assert error is not None and "edge.weight, edge.bias" in error
        assert "distkit.Runtime(..., find_unused_parameters=True)" in error
        assert rank["moved"] == 0.0


def test_with_find_unused_parameters_the_same_loop_equals_one_process(run_on_ranks):
    one = run_on_ranks(user_loop, True, world_size=1)[0]
    for rank in run_on_ranks(user_loop, True, world_size=2):
        assert rank["error"] is None
        assert max_abs_diff(rank["state"], one["state"]) <= exactness.TOL


def test_a_fit_names_the_trainers_argument(run_on_ranks):
    for error in run_on_ranks(trainer_fit, world_size=2):
        assert "distkit.Trainer(..., find_unused_parameters=True)" in error


def test_a_model_no_backward_reached_yet_is_not_taken_for_unused(run_on_ranks):
    assert run_on_ranks(gan_like, world_size=2) == ["trained", "trained"]


def test_a_ddp_keyword_refusal_names_both_homes_of_the_argument():
    with pytest.raises(ConfigurationError, match=r"distkit\.Trainer or distkit\.Runtime"):
        distkit.DDPStrategy(find_unused_parameters=True)
