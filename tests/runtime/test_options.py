"""One options object: every Runtime setting is a field of a frozen, validated RuntimeOptions,
defined once; Runtime(...) builds one from its keywords, the Trainer holds one (no copies) and
checks a Runtime it is given against it field by field (issue 45, item 3)."""

from __future__ import annotations

import dataclasses
import inspect
import signal

import pytest
import torch
from torch import nn

import distkit
from distkit import ConfigurationError, RuntimeOptions
from distkit.trainer._config import RUNTIME_SETTINGS

#: a value other than the default for each setting a Runtime's strategy starts with
_OTHER = {
    "precision": "bf16",
    "grad_accum_steps": 3,
    "sync_batchnorm": True,
    "find_unused_parameters": True,
    "collective_timeout": 120.0,
    "activation_checkpointing": [nn.Linear],
    "deterministic": "warn",
}


def test_the_runtimes_keywords_are_the_options_fields_with_their_defaults():
    params = inspect.signature(distkit.Runtime).parameters
    keywords = {n: p.default for n, p in params.items() if n != "strategy"}
    fields = {f.name: f.default for f in dataclasses.fields(RuntimeOptions) if f.init}
    assert keywords == fields
    assert set(_OTHER) == set(RuntimeOptions.STARTED_WITH)


def test_options_are_frozen_validated_and_canonical():
    options = RuntimeOptions(precision="bfloat16", seed=3)
    assert options.precision == "bf16" and options.seed == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 4  # type: ignore[misc]
    for bad, message in (
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"grad_accum_steps": 0}, "grad_accum_steps must be an integer >= 1, got 0"),
        ({"fault_timeout": "10"}, "fault_timeout"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"sync_batchnorm": 1}, "sync_batchnorm"),
        ({"activation_checkpointing": "Block"}, "activation_checkpointing"),
        ({"requeue": True}, r"Runtime\(requeue=True\) requeues the job"),
    ):
        with pytest.raises(ConfigurationError, match=message):
            RuntimeOptions(**bad)
        with pytest.raises(ConfigurationError, match=message):
            options.replace(**bad)  # a copy is validated as the constructor validates
    with pytest.raises(TypeError, match="unexpected keyword argument 'sed'"):
        options.replace(sed=1)
    signals = RuntimeOptions(preempt_signals=[signal.SIGTERM, "SIGUSR1"]).signals
    assert signals == (signal.SIGTERM, signal.SIGUSR1)


def test_a_runtime_holds_its_options_and_starts_again_from_them():
    options = RuntimeOptions(grad_accum_steps=2, seed=5, precision="bf16", hang_warning=None)
    with distkit.Runtime("dp", **options.keywords()) as rt:
        assert rt.options == options
        strategy = rt.strategy.options
        assert (strategy.precision, strategy.grad_accum_steps) == ("bf16", 2)
    with distkit.Runtime("dp") as rt:
        assert rt.options == RuntimeOptions()


def test_a_trainer_holds_one_and_starts_its_runtime_from_it():
    trainer = distkit.Trainer("dp", seed=4, grad_accum_steps=2, progress=False)
    try:
        held = trainer.config.runtime_options
        assert isinstance(held, RuntimeOptions)
        assert held == RuntimeOptions(seed=4, grad_accum_steps=2)
        assert trainer.runtime.options == held
        assert (trainer.seed, trainer.grad_accum_steps, trainer.config.seed) == (4, 2, 4)
        trainer.seed = 9  # read by each fit: a setting of the next one
        assert trainer.config.runtime_options.seed == 9
        with pytest.raises(
            ConfigurationError,
            match=r"trainer\.grad_accum_steps = 4: the Trainer's Runtime started its strategy "
            r"with grad_accum_steps=2, which it cannot change",
        ):
            trainer.grad_accum_steps = 4  # the strategy (Horovod's, DeepSpeed's) holds 2
        assert (
            trainer.grad_accum_steps == 2 and trainer.runtime.strategy.options.grad_accum_steps == 2
        )
    finally:
        trainer.close()


@pytest.mark.parametrize("name", sorted(_OTHER))
def test_a_given_runtime_is_checked_field_by_field(name):
    other = _OTHER[name]
    with distkit.Runtime("dp") as rt:
        with pytest.raises(
            ConfigurationError, match=rf"Trainer\({name}=.*runtime=\.\.\.\): the runtime was "
        ):
            distkit.Trainer(runtime=rt, **{name: other})
        assert not rt.closed
    with distkit.Runtime("dp", **{name: other}) as rt:
        # the same value (an equal one: a list of the same classes) is the runtime's
        same = [nn.Linear] if name == "activation_checkpointing" else other
        trainer = distkit.Trainer(runtime=rt, progress=False, **{name: same})
        trainer.close()
        left_out = distkit.Trainer(runtime=rt, progress=False)  # left out: the runtime's
        assert getattr(left_out.config.runtime_options, name) == getattr(rt.options, name)
        left_out.close()


def test_the_settings_each_fit_reads_are_the_trainers_over_a_given_runtime():
    with distkit.Runtime("dp", seed=1, fault_timeout=5.0) as rt:
        trainer = distkit.Trainer(runtime=rt, seed=7, hang_warning=None, progress=False)
        held = trainer.config.runtime_options
        assert (held.seed, held.fault_timeout, held.hang_warning) == (7, 10.0, None)
        assert rt.options.seed == 1  # the runtime's own are left as they are
        trainer.close()
    assert {f.name for f in dataclasses.fields(RuntimeOptions)} >= RUNTIME_SETTINGS


def test_a_fit_with_a_given_runtime_trains_like_one_with_its_own():
    """Field by field means the same run: a Trainer over Runtime(grad_accum_steps=2) ends
    with the parameters of Trainer(grad_accum_steps=2), in float64."""

    def fit(**kwargs: object) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(3, 1).double()
        data = torch.utils.data.TensorDataset(
            torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
        )
        with distkit.Trainer(batch_size=4, shuffle=False, progress=False, **kwargs) as trainer:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            trainer.fit(model, optimizer, data, nn.functional.mse_loss)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    own = fit(strategy="dp", grad_accum_steps=2)
    with distkit.Runtime("dp", grad_accum_steps=2) as rt:
        given = fit(runtime=rt)
    once = fit(strategy="dp")  # no accumulation: a different run, so the check can fail
    torch.testing.assert_close(given, own, rtol=0, atol=1e-12)
    assert (once - own).abs().max() > 1e-6
