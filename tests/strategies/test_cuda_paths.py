"""The paths added after the last GPU run, on one CUDA GPU, in one process (issue 30).

Token-exact losses (``distkit.Loss`` in a fit, ``rt.backward(total, count=n)`` in a user
loop) against one plain-torch process on the CPU, at fp32 and under autocast (fp16's
GradScaler included: the step's division by the global count runs after its unscale); the
user loop against the Trainer on the GPU; two models and two optimizers (a GAN) on the GPU;
safetensors weights saved from the GPU and predictions gathered from it; and the token-exact
steps under ``torch.cuda.set_sync_debug_mode("error")``. Every test needs a CUDA GPU and
skips without one (CI has none); docs/gpu.md records their runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.runtime.test_user_loop import trainer_fit, user_loop
from tests.support.gates import needs
from tests.support.token_workloads import Sequences, make_lm, reference, token_sum
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = [needs("cuda"), pytest.mark.timeout(300)]

# autocast against the fp32 CPU reference: a lost unscale or a missing division by the
# count moves the weights by orders of magnitude more than this
LOOSE = 5e-2


def _on_cuda_fit(strategy: str, batch: int, accum: int, count: str, **settings: Any) -> dict:
    """The Trainer's token-exact fit, asserting every batch reaches the step on the GPU."""
    devices: set[str] = set()

    def step(model: nn.Module, b: dict[str, torch.Tensor]) -> distkit.Loss:
        devices.add(b["input_ids"].device.type)
        total, n = token_sum(model, b)
        return distkit.Loss(total, n if count == "tensor" else int(n))

    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=accum, seed=3,
                              max_epochs=2, progress=False, shuffle=False,
                              **settings)  # fmt: skip
    model = make_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    try:
        result = trainer.fit(model, optimizer, Sequences(), step_fn=step)
        state = trainer.full_state_dict()
    finally:
        trainer.close()
    assert devices == {"cuda"}, devices
    return {"state": state, "history": result.history}


@pytest.mark.parametrize("count", ["tensor", "int"])
@pytest.mark.parametrize("strategy", ["dp", "ddp", "fsdp"])
def test_cuda_token_exact_fit_equals_one_cpu_process_over_every_token(strategy, count):
    got = _on_cuda_fit(strategy, 4, 2, count)
    assert max_abs_diff(got["state"], reference(8)) <= 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_token_exact_fit_under_autocast_stays_with_the_fp32_reference(precision):
    got = _on_cuda_fit("ddp", 4, 2, "tensor", precision=precision)
    assert max_abs_diff(got["state"], reference(8)) <= LOOSE
    losses = [row["train_loss"] for row in got["history"]]
    assert all(loss == loss and loss < 10 for loss in losses), losses  # finite, not blown up


@pytest.mark.parametrize("precision", ["32", "fp16"])
def test_cuda_token_exact_user_loop_equals_one_cpu_process(precision):
    with distkit.Runtime("ddp", grad_accum_steps=2, seed=3, precision=precision) as rt:
        assert rt.device.type == "cuda"
        model = make_lm()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        for _ in range(2):
            for b in rt.loader(Sequences(), batch_size=4, shuffle=False):
                total, n = token_sum(model, b)
                rt.backward(total, count=n)
                optimizer.step()
                optimizer.zero_grad()
        state = rt.full_state_dict(model)
    assert max_abs_diff(state, reference(8)) <= (1e-4 if precision == "32" else LOOSE)


@pytest.mark.parametrize("precision", ["32", "bf16", "fp16"])
def test_cuda_user_loop_is_the_trainers_fit(precision):
    """The same batches through the same autocast and scaler on the GPU (fp16: scaled
    backward, unscale before clipping, the scaler's step and update)."""
    loop = user_loop("ddp", 8, 2, precision=precision, clip=0.5)
    fit = trainer_fit(8, 2, precision=precision, clip=0.5)
    # fp32: the same numbers. Under autocast the loop computes its loss outside the autocast
    # on float32 logits (as Fabric and Accelerate do) and the Trainer inside it: on an H200
    # the two differ by 2.1e-4 (bf16) and 4.8e-5 (fp16) here, run after run (each path
    # repeats itself exactly), the size of fp16 against fp32 itself (1.9e-4); a lost
    # scaling or division moves the weights by orders of magnitude more
    tolerance = 1e-6 if precision == "32" else 2e-3
    assert max_abs_diff(loop["state"], fit["state"]) <= tolerance


def _gan(strategy: str) -> dict[str, Any]:
    features = make_dataset(1).tensors[0].shape[1]
    torch.manual_seed(0)
    with distkit.Runtime(strategy, seed=5) as rt:
        gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, features))
        disc = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 1))
        gen, opt_g = rt.setup(gen, torch.optim.Adam(gen.parameters(), lr=1e-2))
        disc, opt_d = rt.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
        bce = nn.functional.binary_cross_entropy_with_logits
        for x, _ in rt.loader(make_dataset(21), batch_size=8, shuffle=False):
            assert x.is_cuda
            ones, zeros = torch.ones(len(x), 1, device=x.device), torch.zeros_like(x[:, :1])
            fake = gen(torch.tanh(x[:, :4]))
            opt_d.zero_grad()
            rt.backward(bce(disc(torch.cat([x, fake.detach()])), torch.cat([ones, zeros])))
            opt_d.step()
            opt_g.zero_grad()
            rt.backward(bce(disc(fake), ones), optimizer=opt_g)
            opt_g.step()
        return {"gen": rt.full_state_dict(gen), "disc": rt.full_state_dict(disc)}


def _gan_on_cpu() -> dict[str, Any]:
    """The same GAN in plain torch on the CPU."""
    features = make_dataset(1).tensors[0].shape[1]
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, features))
    disc = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    bce = nn.functional.binary_cross_entropy_with_logits
    for x in make_dataset(21).tensors[0].split(8):
        ones, zeros = torch.ones(len(x), 1), torch.zeros(len(x), 1)
        fake = gen(torch.tanh(x[:, :4]))
        opt_d.zero_grad()
        bce(disc(torch.cat([x, fake.detach()])), torch.cat([ones, zeros])).backward()
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), ones).backward()
        opt_g.step()
    return {"gen": gen.state_dict(), "disc": disc.state_dict()}


@pytest.mark.parametrize("strategy", ["dp", "ddp", "fsdp"])
def test_cuda_gan_with_two_models_and_two_optimizers_trains_as_on_the_cpu(strategy):
    got = _gan(strategy)
    cpu = _gan_on_cpu()
    assert max_abs_diff(got["gen"], cpu["gen"]) <= 1e-4
    assert max_abs_diff(got["disc"], cpu["disc"]) <= 1e-4


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cuda_weights_and_predictions_come_back_from_the_gpu(strategy, tmp_path):
    from distkit import load_weights

    data = make_dataset(13)
    with distkit.Runtime(strategy, seed=0) as rt:
        net = make_mlp()
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for x, y in rt.loader(data, batch_size=4):
            rt.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        state = rt.full_state_dict(model)
        rt.save_weights(model, tmp_path / "w.safetensors")
        outputs = rt.predict(model, data, batch_size=5)
    fresh = make_mlp(seed=1)
    load_weights(fresh, tmp_path / "w.safetensors")
    assert max_abs_diff(fresh.state_dict(), state) == 0
    assert len(outputs) == len(data)
    with torch.no_grad():
        expected = fresh(data.tensors[0])
    got = torch.stack([torch.as_tensor(o) for o in outputs])
    assert got.device.type == "cpu"
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("strategy", ["dp", "ddp", "fsdp"])
def test_cuda_token_exact_steps_raise_nothing_in_sync_debug_mode(strategy):
    """Token-exact steps with device counts: after the first step's agreement, each step
    all-reduces its count on the GPU and reads nothing; under ``set_sync_debug_mode("error")``
    any read (``.item()``, a Python ``if`` on a device tensor, a blocking copy) raises."""
    log_every = 4

    class Strict(distkit.Callback):
        stops_training = False

        def on_train_step_end(self, trainer, logs):
            # the first step agrees on the kind of loss (host side) and a log point reads;
            # every other step runs with synchronisation as an error
            strict = logs["step"] % log_every != 0
            torch.cuda.set_sync_debug_mode("error" if strict else 0)

    def step(model: nn.Module, b: dict[str, torch.Tensor]) -> distkit.Loss:
        total, n = token_sum(model, b)
        return distkit.Loss(total, n)

    trainer = distkit.Trainer(strategy, batch_size=4, grad_accum_steps=2, max_epochs=1,
                              progress=False, log_every_n_steps=log_every, callbacks=[Strict()],
                              shuffle=False, gradient_clip_norm=1.0)  # fmt: skip
    model = make_lm()
    try:
        # 64 samples, 4 per micro-batch, 2 per step: 8 steps, the last a log point (the
        # epoch's end reads its losses: a check point)
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), Sequences(n=64),
                    step_fn=step)  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode(0)
        trainer.close()


def _fit_to(strategy: str, epochs: int, folder: str | None, make_optimizer: Any) -> dict:
    trainer = distkit.Trainer(strategy, batch_size=8, seed=5, max_epochs=epochs, progress=False,
                              checkpoint_dir=folder, resume="auto" if folder else None)  # fmt: skip
    net = make_mlp()
    try:
        trainer.fit(net, make_optimizer(net.parameters()), make_dataset(40),
                    loss_fn=nn.functional.cross_entropy)  # fmt: skip
        return {"state": trainer.full_state_dict(), "steps": trainer.global_step}
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "make_optimizer",
    [
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), id="sgd-momentum"),
        pytest.param(lambda p: torch.optim.Adam(p, lr=1e-2), id="adam"),
    ],
)
@pytest.mark.parametrize("strategy", ["dp", "ddp", "fsdp"])
def test_cuda_resumed_fit_with_optimizer_state_equals_the_uninterrupted_one(
    strategy, make_optimizer, tmp_path
):
    """The checkpoint's optimizer state is loaded before the set-up moves the model to the
    GPU; it must follow the parameters there (the first GPU runs: every resumed fit with
    momentum or Adam failed at its first step, 'Expected all tensors to be on the same
    device')."""
    whole = _fit_to(strategy, 2, None, make_optimizer)
    _fit_to(strategy, 1, str(tmp_path), make_optimizer)
    resumed = _fit_to(strategy, 2, str(tmp_path), make_optimizer)
    assert resumed["steps"] == whole["steps"] == 10
    assert max_abs_diff(resumed["state"], whole["state"]) <= 1e-5


# ---------------------------------------------------- real NVIDIA apex (and a GPU) for these
@needs("apex")
@pytest.mark.parametrize("precision", ["32", "fp16"])
def test_cuda_real_apex_token_exact_fit_equals_one_cpu_process(precision):
    """The step's division by the global count on apex: legacy O1 scales the loss in
    ``amp.scale_loss`` and unscales into the gradients, modern apex uses torch's scaler."""
    got = _on_cuda_fit("apex", 4, 2, "tensor", precision=precision)
    assert max_abs_diff(got["state"], reference(8)) <= (1e-4 if precision == "32" else LOOSE)


@needs("apex")
@pytest.mark.parametrize("precision", ["32", "fp16"])
def test_cuda_real_apex_user_loop_trains_like_ddp(precision):
    apex_run = user_loop("apex", 8, 2, precision=precision, clip=0.5)
    ddp_run = user_loop("ddp", 8, 2, precision=precision, clip=0.5)
    tolerance = 1e-5 if precision == "32" else LOOSE
    assert max_abs_diff(apex_run["state"], ddp_run["state"]) <= tolerance


@needs("apex")
def test_cuda_real_apex_gan_trains_as_on_the_cpu():
    got = _gan("apex")
    cpu = _gan_on_cpu()
    assert max_abs_diff(got["gen"], cpu["gen"]) <= 1e-4
    assert max_abs_diff(got["disc"], cpu["disc"]) <= 1e-4
