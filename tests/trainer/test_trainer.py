"""The trainer core: world-size invariance, backend equivalence, accumulation, evaluation.

Multi-process cases run on real processes joined by gloo on loopback.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distkit
from tests.support.exactness import TOL  # the runs compared train in float64
from tests.support.gates import needs
from tests.support.workloads import (
    hand_ddp_on_rank,
    make_dataset,
    make_mlp,
    max_abs_diff,
    state_of,
    train_by_hand,
    train_with_distkit,
)

pytestmark = pytest.mark.timeout(180)


def _train(strategy: str, batch_size: int, n: int, accum: int = 1, **kwargs) -> dict:
    return train_with_distkit(strategy, batch_size, n=n, grad_accum_steps=accum, **kwargs)


@pytest.mark.parametrize("n", [64, 61])  # 61: a short last global batch, split unevenly
def test_trainer_ddp_two_processes_equal_one_process_with_double_batch(n, run_on_ranks):
    two = run_on_ranks(_train, "ddp", 4, n, world_size=2)
    one = run_on_ranks(_train, "ddp", 8, n, world_size=1)[0]
    assert max_abs_diff(two[0]["state"], two[1]["state"]) == 0.0
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL
    assert two[0]["history"] == two[1]["history"], "history differs between ranks"
    for a, b in zip(two[0]["history"], one["history"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=TOL)
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=TOL)
        assert a["val_acc"] == b["val_acc"]


def test_trainer_tail_smaller_than_world_is_weighted_out(run_on_ranks):
    # 17 samples, global batch 8 on 2 ranks: the last global batch holds 1 sample, so rank 1
    # trains on a zero-weight placeholder and still joins the all-reduce.
    two = run_on_ranks(_train, "ddp", 4, 17, world_size=2)
    one = run_on_ranks(_train, "ddp", 8, 17, world_size=1)[0]
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL


def test_trainer_accumulation_equals_bigger_batch(run_on_ranks):
    accumulated = run_on_ranks(_train, "ddp", 2, 61, 2, world_size=2)
    big = run_on_ranks(_train, "ddp", 8, 61, world_size=1)[0]
    assert max_abs_diff(accumulated[0]["state"], big["state"]) <= TOL


def test_trainer_sync_batchnorm_makes_bn_models_world_size_invariant(run_on_ranks):
    two = run_on_ranks(partial(_train, model="bn", sync_batchnorm=True), "ddp", 4, 64, world_size=2)
    one = run_on_ranks(partial(_train, model="bn"), "ddp", 8, 64, world_size=1)[0]
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL  # running stats included


def test_trainer_ddp_dp_and_hand_written_loop_agree(run_on_ranks):
    ddp = run_on_ranks(_train, "ddp", 4, 64, world_size=2)[0]
    dp = _train("dp", 8, 64)
    hand_one = train_by_hand(8, n=64)
    hand_ddp = run_on_ranks(hand_ddp_on_rank, 4, 64, 2, world_size=2)[0]
    assert max_abs_diff(dp["state"], hand_one["state"]) <= TOL
    assert max_abs_diff(ddp["state"], hand_ddp["state"]) <= TOL
    assert max_abs_diff(ddp["state"], dp["state"]) <= TOL


def test_trainer_user_dataloader_gets_sharded(run_on_ranks):
    two = run_on_ranks(partial(_train, as_loader=True), "ddp", 4, 64, world_size=2)
    one = _train("dp", 8, 64)
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_mixed_precision_trains_on_cpu(precision):
    result = _train("dp", 8, 64, precision=precision, epochs=3)
    losses = [h["train_loss"] for h in result["history"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


class _Recorder(nn.Module):
    """Predicts class = sample id % 3 for ids whose bit is set, else a wrong class."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.extend(ids.view(-1).tolist())
        good = (ids.view(-1) % 2 == 0).long()
        pred = (ids.view(-1) % 3 + 1 - good) % 3
        return nn.functional.one_hot(pred, 3).float() + self.weight


def _evaluate_exactly_once() -> dict:
    ids = torch.arange(7)
    dataset = TensorDataset(ids, ids % 3)
    trainer = distkit.Trainer("ddp", batch_size=2, progress=False)
    model = _Recorder()
    scores = trainer.evaluate(model, dataset, metrics={"acc": distkit.Accuracy()})
    trainer.close()
    return {"scores": scores, "seen": model.seen}


def test_trainer_evaluate_counts_every_sample_exactly_once(run_on_ranks):
    results = run_on_ranks(_evaluate_exactly_once, world_size=2)
    seen = results[0]["seen"] + results[1]["seen"]
    assert sorted(seen) == list(range(7)), "a sample was skipped or padded in"
    expected = sum(1 for i in range(7) if i % 2 == 0) / 7
    assert results[0]["scores"]["acc"] == pytest.approx(expected)
    assert results[0]["scores"] == results[1]["scores"]


def _dp_under_torchrun() -> str:
    try:
        distkit.Trainer("dp", progress=False)
    except distkit.LauncherMismatchError as exc:
        return str(exc)
    return "no error"


def test_trainer_dp_under_multiprocess_launcher_is_refused(run_on_ranks):
    messages = run_on_ranks(_dp_under_torchrun, world_size=2)
    for message in messages:
        assert "single process" in message and "strategy='ddp'" in message


def _fit_tiny_dataset() -> str:
    trainer = distkit.Trainer("ddp", progress=False)
    model = nn.Linear(2, 2)
    data = TensorDataset(torch.randn(1, 2), torch.tensor([0]))
    try:
        trainer.fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data,
            loss_fn=nn.functional.cross_entropy,
        )
    except distkit.ConfigurationError as exc:
        return str(exc)
    finally:
        trainer.close()
    return "no error"


def test_trainer_dataset_smaller_than_world_is_refused(run_on_ranks):
    for message in run_on_ranks(_fit_tiny_dataset, world_size=2):
        assert "1 sample" in message and "2 processes" in message


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"max_epochs": -1}, "max_epochs must be an integer >= 0"),
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"num_workers": -2}, "num_workers"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"scheduler_interval": "batch"}, "scheduler_interval"),
    ],
)
def test_trainer_rejects_bad_arguments(kwargs, words):
    with pytest.raises(distkit.ConfigurationError, match=words.replace("(", r"\(")):
        distkit.Trainer("dp", progress=False, **kwargs)


def test_trainer_unknown_strategy_suggests_closest_name():
    with pytest.raises(
        distkit.UnknownStrategyError,
        match=r"Did you mean 'ddp'\?.*Available: auto, apex, ddp, deepspeed, dp, fsdp, horovod",
    ):
        distkit.Trainer("ddpp")


def _fit_expecting_error(**fit_kwargs) -> None:
    trainer = distkit.Trainer("dp", progress=False)
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    kwargs = {"loss_fn": nn.functional.cross_entropy, **fit_kwargs}
    optimizer = kwargs.pop("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit(model, optimizer, data, **kwargs)


def test_trainer_fit_rejects_non_scalar_loss():
    with pytest.raises(distkit.ConfigurationError, match=r"shape \(8,\)"):
        _fit_expecting_error(
            loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")
        )


def test_trainer_fit_rejects_optimizer_of_another_model():
    other = nn.Linear(3, 2)
    with pytest.raises(distkit.ConfigurationError, match="not parameters of the model"):
        _fit_expecting_error(optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_trainer_fit_needs_loss_fn_or_step_fn():
    with pytest.raises(distkit.ConfigurationError, match=r"loss_fn.*step_fn"):
        _fit_expecting_error(loss_fn=None)


def test_trainer_step_fn_and_step_scheduler():
    trainer = distkit.Trainer(
        "dp", progress=False, batch_size=4, scheduler_interval="step", max_epochs=2
    )
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    calls = []

    def step_fn(m, batch):
        calls.append(len(batch[0]))
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    trainer.fit(model, optimizer, data, step_fn=step_fn, scheduler=scheduler)
    assert calls == [4] * 8
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5**8)


def test_trainer_model_holds_trained_weights_and_loader_batch_size_wins():
    trainer = distkit.Trainer("dp", progress=False, batch_size=32)
    model = nn.Linear(3, 1)
    before = model.weight.detach().clone()
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    seen = []

    def step_fn(m, batch):
        seen.append(len(batch[0]))
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=5),
        step_fn=step_fn,
    )
    assert seen == [5, 5, 2]
    assert not torch.equal(model.weight.cpu(), before.cpu())


def _fit_twice_then_new_optimizer() -> list[float]:
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False)
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for optimizer in (first, first, torch.optim.SGD(model.parameters(), lr=0.05)):
        result = trainer.fit(model, optimizer, data, loss_fn=nn.functional.mse_loss)
        losses.append(result.history[-1]["train_loss"])
    trainer.close()
    return losses


def test_trainer_fit_again_reuses_the_set_up_and_accepts_a_new_optimizer(run_on_ranks):
    # wrapping the model twice would register DDP's gradient hooks twice
    results = run_on_ranks(_fit_twice_then_new_optimizer, world_size=2)
    assert results[0] == results[1]
    assert results[0][2] < results[0][0]


def _stale_gradients(stale: bool) -> dict:
    """A fit after the user left gradients on the parameters (a manual backward, say)."""
    model = make_mlp()
    if stale:
        for p in model.parameters():
            p.grad = torch.full_like(p, 100.0)
    seen: list[bool] = []

    class Grads(distkit.Callback):
        stops_training = False

        def on_train_step_end(self, trainer, logs):  # the step's gradients are still there
            seen.append(all(p.grad is not None for p in model.parameters()))

    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=2, progress=False,
                              callbacks=[Grads()])  # fmt: skip
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(32),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    return {"state": state_of(model), "seen": seen,
            "after": [p.grad for p in model.parameters()]}  # fmt: skip


def test_trainer_gradients_are_cleared_before_each_step_not_after():
    """Each step starts from zero gradients (a user's stale ones never reach the first step),
    callbacks after a step see its gradients, and fit ends with none held (set to None)."""
    clean, stale = _stale_gradients(False), _stale_gradients(True)
    assert max_abs_diff(clean["state"], stale["state"]) == 0.0
    assert clean["seen"] == [True] * 8
    assert stale["after"] == [None] * 4


def test_trainer_leaves_cudnn_benchmark_as_the_user_set_it(monkeypatch):
    """distkit once switched cudnn.benchmark on behind the user's back on CUDA; now only
    cudnn_benchmark=True does (see the CUDA test below)."""
    for setting in (False, True):
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", setting)
        distkit.Trainer("dp", progress=False).close()
        assert torch.backends.cudnn.benchmark is setting


@needs("cuda")
def test_trainer_cudnn_benchmark_true_switches_it_on_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    distkit.Trainer("dp", progress=False, cudnn_benchmark=True).close()
    assert torch.backends.cudnn.benchmark is True


def test_trainer_settings_are_one_frozen_validated_config():
    """Trainer(...) builds one TrainerConfig; assigning a setting replaces it, validated again
    (before, trainer.max_epochs = "3" was taken as it was and failed later, or not at all)."""
    import dataclasses
    import inspect

    from distkit.trainer._config import RUNTIME_SETTINGS, TrainerConfig

    trainer = distkit.Trainer("dp", max_epochs=2, seed=7, progress=False)
    assert isinstance(trainer.config, TrainerConfig)
    assert (trainer.config.max_epochs, trainer.config.seed) == (2, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.config.max_epochs = 3  # type: ignore[misc]
    trainer.max_epochs = 4
    assert trainer.config.max_epochs == 4 and trainer.max_epochs == 4
    with pytest.raises(
        distkit.ConfigurationError, match="max_epochs must be an integer >= 0, got '3'"
    ):
        trainer.max_epochs = "3"
    assert trainer.config.max_epochs == 4
    with pytest.raises(distkit.ConfigurationError, match="resume='auto' needs checkpoint_dir"):
        trainer.resume = "auto"
    # every keyword of Trainer(...) but the objects is a field, with the same default
    params = inspect.signature(distkit.Trainer).parameters
    settings = {
        n: p.default
        for n, p in params.items()
        if n not in ("strategy", "callbacks", "loggers", "runtime")
    }
    fields = {
        f.name: f.default
        for f in dataclasses.fields(TrainerConfig)
        if f.init and f.name != "runtime_options"
    }
    runtime = {f.name: f.default for f in dataclasses.fields(distkit.RuntimeOptions) if f.init}
    # the Runtime's settings are one RuntimeOptions, with the Runtime's defaults; the
    # Trainer's preempt_signals and requeue are its own (a fit saves in checkpoint_dir)
    assert settings == fields | {name: runtime[name] for name in RUNTIME_SETTINGS}
    assert set(fields).isdisjoint(RUNTIME_SETTINGS) and set(runtime) >= RUNTIME_SETTINGS
    assert trainer.config.runtime_options.seed == 7 and trainer.config.seed == 7
    # what the loop reads is derived once, in the config, and follows a replaced setting
    assert trainer.config.clip is None and trainer.gradient_clip is None
    trainer.config = trainer.config.replace(gradient_clip_norm=0.5)
    assert trainer.gradient_clip is not None and trainer.gradient_clip.max_norm == 0.5
    trainer.close()
