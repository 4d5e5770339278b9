"""A user's own loop on distkit.Runtime keeps world-size invariance: the same loop at 2
processes with batch b ends with the weights of 1 process with batch 2b (an uneven last batch
and grad_accum_steps=2 included), on ddp, fsdp and horovod; at 1 process it equals the
Trainer's fit. Real gloo / horovodrun processes."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.support.exactness import DTYPE, TOL  # the runs compared train in float64
from tests.support.gates import needs
from tests.support.horovod_runner import RankError, run_with_horovodrun
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)
N = 21  # global batches of 8 with 2 accumulated: 16 + 5 (an uneven last step)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def user_loop(
    strategy: str,
    batch: int,
    accum: int,
    *,
    epochs: int = 2,
    clip: float | None = None,
    precision: str = "32",
) -> dict[str, Any]:
    """The loop of the issue's sketch: setup, loader, backward, (clip), step, zero_grad; in
    float64 at full precision (the runs are compared), in float32 for mixed precision."""
    torch.manual_seed(0)
    dtype = DTYPE if precision == "32" else torch.float32
    with distkit.Runtime(strategy, grad_accum_steps=accum, seed=3, precision=precision) as rt:
        model = make_mlp(dtype=dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(make_dataset(N, dtype=dtype), batch_size=batch, shuffle=True)
        batches = 0
        for _ in range(epochs):
            for x, y in loader:
                rt.backward(_loss(model(x), y))
                if clip is not None:
                    rt.clip_gradients(model, optimizer, max_norm=clip)
                optimizer.step()
                optimizer.zero_grad()
                batches += 1
        return {"state": rt.full_state_dict(model), "batches": batches, "len": len(loader)}


def two_losses_loop(strategy: str, batch: int, accum: int) -> dict[str, Any]:
    """Two rt.backward calls per batch on one model (the docs: "call it for every loss"),
    with accumulation: its gradients are the sum of both losses' over the window."""
    torch.manual_seed(0)
    with distkit.Runtime(strategy, grad_accum_steps=accum, seed=3) as rt:
        model = make_mlp(dtype=DTYPE)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        for x, y in rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch, shuffle=True):
            rt.backward(_loss(model(x), y))
            rt.backward(model(x).pow(2).mean() * 0.1)  # a second loss, a second forward
            optimizer.step()
            optimizer.zero_grad()
        return {"state": rt.full_state_dict(model)}


def trainer_fit(
    batch: int, accum: int, *, epochs: int = 2, precision: str = "32", clip: float | None = None
) -> dict[str, Any]:
    torch.manual_seed(0)
    dtype = DTYPE if precision == "32" else torch.float32
    trainer = distkit.Trainer("ddp", batch_size=batch, grad_accum_steps=accum, seed=3,
                              max_epochs=epochs, progress=False, precision=precision,
                              gradient_clip_norm=clip)  # fmt: skip
    model = make_mlp(dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer.fit(model, optimizer, make_dataset(N, dtype=dtype), _loss)
    state = trainer.full_state_dict()
    trainer.close()
    return {"state": state}


@pytest.mark.parametrize("accum", [1, 2])
def test_a_user_loop_at_two_ddp_ranks_equals_one_process_and_the_trainer(run_on_ranks, accum):
    one = run_on_ranks(user_loop, "ddp", 8, accum, world_size=1)[0]
    two = run_on_ranks(user_loop, "ddp", 4, accum, world_size=2)
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL
    assert max_abs_diff(two[1]["state"], one["state"]) <= TOL
    # 21 samples: 3 global batches of 8 (the last holds 5: 3 and 2 over two ranks)
    assert one["len"] == two[0]["len"] == two[1]["len"] == 3
    assert one["batches"] == two[0]["batches"] == 6  # 2 epochs
    fit = run_on_ranks(trainer_fit, 8, accum, world_size=1)[0]
    assert max_abs_diff(one["state"], fit["state"]) <= TOL  # the loop is the Trainer's


def test_a_user_loop_with_clipping_at_two_ranks_equals_one_process(run_on_ranks):
    clipped = partial(user_loop, clip=0.05)
    one = run_on_ranks(clipped, "ddp", 8, 2, world_size=1)[0]
    two = run_on_ranks(clipped, "ddp", 4, 2, world_size=2)
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL
    unclipped = run_on_ranks(user_loop, "ddp", 8, 2, world_size=1)[0]
    assert max_abs_diff(unclipped["state"], one["state"]) > 1e-3  # the clip did act


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_user_loop_in_reduced_precision_is_the_trainers_fit(run_on_ranks, precision):
    """The same batches through the same autocast, loss scaling and scaler steps (fp16:
    scaled backward, unscale before clipping, the scaler's step and update)."""
    loop = run_on_ranks(
        partial(user_loop, precision=precision, clip=0.5), "ddp", 8, 2, world_size=1
    )[0]
    fit = run_on_ranks(partial(trainer_fit, precision=precision, clip=0.5), 8, 2, world_size=1)
    # one process, the same arithmetic in the same order: bitwise (measured 0.0)
    assert max_abs_diff(loop["state"], fit[0]["state"]) == 0.0


def test_a_user_loop_on_fsdp_at_two_ranks_equals_one_process(run_on_ranks):
    one = run_on_ranks(user_loop, "ddp", 8, 2, world_size=1)[0]
    two = run_on_ranks(user_loop, "fsdp", 4, 2, world_size=2)
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL
    assert max_abs_diff(two[1]["state"], one["state"]) <= TOL


@needs("horovod")
def test_a_user_loop_on_horovod_at_two_ranks_equals_one_process(run_on_ranks, tmp_path):
    one = run_on_ranks(user_loop, "ddp", 8, 2, world_size=1)[0]
    calls = [("tests.runtime.test_user_loop", "user_loop", ("horovod", 4, 2), {})]
    ranks = run_with_horovodrun(calls, tmp_path)
    for (result,) in ranks:
        assert max_abs_diff(result["state"], one["state"]) <= TOL


FEATURES = make_dataset(1).tensors[0].shape[1]


def gan_loop(strategy: str, batch: int, accum: int = 1) -> dict[str, Any]:
    """Two models, two optimizers, two backward calls per batch (a GAN's discriminator and
    generator); the noise is a function of the batch, so any world size draws the same."""
    torch.manual_seed(0)
    with distkit.Runtime(strategy, seed=5, grad_accum_steps=accum) as rt:
        gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, FEATURES)).to(DTYPE)
        disc = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1)).to(DTYPE)
        gen, opt_g = rt.setup(gen, torch.optim.Adam(gen.parameters(), lr=1e-2))
        disc, opt_d = rt.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
        bce = nn.functional.binary_cross_entropy_with_logits
        for x, _ in rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch):
            fake = gen(torch.tanh(x[:, :4]))
            scores = disc(torch.cat([x, fake.detach()]))
            real = torch.ones(len(x), 1, dtype=DTYPE)
            labels = torch.cat([real, torch.zeros_like(real)])
            opt_d.zero_grad()
            rt.backward(bce(scores, labels))
            opt_d.step()
            opt_g.zero_grad()
            # optimizer=: the loss reaches both models; legacy apex needs to know (see
            # test_user_loop_apex), every other backend ignores it
            rt.backward(bce(disc(fake), real), optimizer=opt_g)
            opt_g.step()
        return {"gen": rt.full_state_dict(gen), "disc": rt.full_state_dict(disc)}


def test_a_gan_with_two_models_and_optimizers_at_two_ranks_equals_one_process(run_on_ranks):
    one = run_on_ranks(gan_loop, "ddp", 8, world_size=1)[0]
    two = run_on_ranks(gan_loop, "ddp", 4, world_size=2)
    for rank in two:
        assert max_abs_diff(rank["gen"], one["gen"]) <= TOL
        assert max_abs_diff(rank["disc"], one["disc"]) <= TOL


@needs("horovod")
def test_a_gan_on_horovod_at_two_ranks_equals_one_process(run_on_ranks, tmp_path):
    """The generator's backward reaches the discriminator's parameters (Horovod starts their
    all-reduces); the discriminator's zero_grad collects them instead of failing."""
    ones = [run_on_ranks(gan_loop, "ddp", 8, accum, world_size=1)[0] for accum in (1, 2)]
    calls = [("tests.runtime.test_user_loop", "gan_loop", ("horovod", 4, a), {}) for a in (1, 2)]
    for results in run_with_horovodrun(calls, tmp_path):
        for result, one in zip(results, ones, strict=True):  # accumulation 1, then 2
            assert max_abs_diff(result["gen"], one["gen"]) <= TOL
            assert max_abs_diff(result["disc"], one["disc"]) <= TOL


def test_two_backwards_per_batch_at_two_ranks_equal_one_process(run_on_ranks):
    """Two losses, two rt.backward calls per batch on one model, accumulation 2: ddp
    averages each backward's gradients, so 2 ranks equal 1 process with the whole batch."""
    one = run_on_ranks(two_losses_loop, "ddp", 8, 2, world_size=1)[0]
    for rank in run_on_ranks(two_losses_loop, "ddp", 4, 2, world_size=2):
        assert max_abs_diff(rank["state"], one["state"]) <= TOL


@needs("horovod")
def test_two_backwards_per_batch_on_horovod_are_refused_naming_the_fix(tmp_path):
    """Horovod's DistributedOptimizer all-reduces after a fixed number of backward passes:
    a loop with more per step got its raw AssertionError ("Gradients were computed more
    than backward_passes_per_step times"); now a distkit error saying what to do instead,
    on every rank, with accumulation or without."""
    calls = [
        ("tests.runtime.test_user_loop", "two_losses_loop", ("horovod", 4, accum), {})
        for accum in (1, 2)
    ]
    for rank in run_with_horovodrun(calls, tmp_path):
        for refusal in rank:
            assert isinstance(refusal, RankError), refusal
            text = str(refusal)
            assert "UnsupportedFeatureError" in text and "AssertionError" not in text
            assert "rt.backward(loss_a + loss_b)" in text and "strategy='ddp'" in text


def parts_loop(strategy: str, batch: int) -> dict[str, Any]:
    """One model, two optimizers over its two parts (SGD for the body, Adam for the head),
    stepped one after the other; accumulation 2 with an uneven last window."""
    torch.manual_seed(0)
    with distkit.Runtime(strategy, grad_accum_steps=2, seed=3) as rt:
        model = make_mlp(dtype=DTYPE)
        body, head = list(model.parameters())[:2], list(model.parameters())[2:]
        model, opt_body, opt_head = rt.setup(
            model, torch.optim.SGD(body, lr=0.1, momentum=0.9), torch.optim.Adam(head, lr=1e-2)
        )
        for _ in range(2):
            for x, y in rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch):
                rt.backward(_loss(model(x), y))
                opt_body.step()
                opt_head.step()
                opt_body.zero_grad()
                opt_head.zero_grad()
        return {"state": rt.full_state_dict(model)}


def test_one_model_with_two_optimizers_at_two_ranks_equals_one_process(run_on_ranks):
    one = run_on_ranks(parts_loop, "ddp", 8, world_size=1)[0]
    for rank in run_on_ranks(parts_loop, "ddp", 4, world_size=2):
        assert max_abs_diff(rank["state"], one["state"]) <= TOL


def overlapping_optimizers() -> str:
    with distkit.Runtime("horovod") as rt:
        model = make_mlp()
        try:
            rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     torch.optim.Adam(list(model.parameters())[2:]))  # fmt: skip
        except distkit.UnsupportedFeatureError as exc:
            return str(exc)
    return "no error"


@needs("horovod")
def test_one_model_with_two_optimizers_on_horovod_equals_one_process(run_on_ranks, tmp_path):
    """A DistributedOptimizer per optimizer, each over its own part of the model; two
    optimizers over the same parameters are refused (Horovod's hooks cannot be shared)."""
    one = run_on_ranks(parts_loop, "ddp", 8, world_size=1)[0]
    calls = [
        ("tests.runtime.test_user_loop", "parts_loop", ("horovod", 4), {}),
        ("tests.runtime.test_user_loop", "overlapping_optimizers", (), {}),
    ]
    for result, refusal in run_with_horovodrun(calls, tmp_path):
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert "2 parameter(s) of this Adam belong to an optimizer set up before" in refusal
