"""The Strategy's narrower surface: state I/O and elastic training as capability objects,
one start, the scaler's state on the precision; and plugins written against the hooks these
replaced (a warning and the old behaviour, or an error naming the new hook at class creation,
never silently ignored)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.strategies.base import TrainOptions
from distkit.strategies.capabilities import Elastic, StateIO
from distkit.strategies.dp import DataParallelStrategy
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(120)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def test_a_built_in_strategy_has_a_state_io_and_no_elastic_runner():
    strategy = DataParallelStrategy()
    strategy.start(TrainOptions())
    assert type(strategy.state_io) is StateIO and strategy.elastic is None
    model = make_mlp()
    state = strategy.state_io.model_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert all(v.device.type == "cpu" for v in state.values())
    strategy.teardown()


def test_start_takes_the_options_once_and_refuses_others():
    strategy = DataParallelStrategy()
    strategy.start(TrainOptions(grad_accum_steps=2))
    strategy.start()  # again, no options: nothing changes
    strategy.start(TrainOptions(grad_accum_steps=2))  # the same options: fine
    assert strategy.options.grad_accum_steps == 2
    with pytest.raises(distkit.ConfigurationError, match="cannot be reconfigured"):
        strategy.start(TrainOptions(grad_accum_steps=3))
    strategy.teardown()


def test_the_scaler_state_is_the_precisions_in_grad_scaler_form():
    strategy = DataParallelStrategy()
    strategy.start(TrainOptions(precision="32"))
    assert strategy.precision.state_dict() == {}  # no scaler at fp32
    strategy.teardown()


def test_old_names_on_a_strategy_still_work_with_a_deprecation_warning():
    strategy = DataParallelStrategy()
    with pytest.warns(DeprecationWarning, match=r"strategy\.connect is deprecated: use "):
        strategy.connect(TrainOptions())
    with pytest.warns(DeprecationWarning, match=r"use strategy\.state_io\.model_state_dict"):
        state = strategy.model_state_dict(make_mlp())
    assert "0.weight" in state
    ran = []
    with pytest.warns(DeprecationWarning, match="strategy.elastic"):
        strategy.run_training(lambda: ran.append(1), None)
    assert ran == [1]  # no elastic runner: the body once
    with pytest.raises(AttributeError, match="has no attribute 'no_such_hook'"):
        strategy.no_such_hook  # noqa: B018
    strategy.teardown()


def test_a_plugin_overriding_the_old_state_hooks_warns_and_is_still_called(tmp_path):
    calls: list[str] = []
    with pytest.warns(DeprecationWarning, match=r"model_state_dict overrides a Strategy hook"):

        class OldStatePlugin(DataParallelStrategy):
            name = "old-state"

            def model_state_dict(self, model: nn.Module, *, rank0_only: bool = False) -> Any:
                calls.append("model_state_dict")
                return {k: v.detach().clone() for k, v in model.state_dict().items()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing else warns on the way
        trainer = distkit.Trainer(
            OldStatePlugin(), progress=False, checkpoint_dir=tmp_path, batch_size=8
        )
        model = make_mlp()
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16), _loss)
        full = trainer.full_state_dict()
    assert calls == ["model_state_dict", "model_state_dict"]  # the checkpoint, then full_*
    assert full.keys() == model.state_dict().keys()
    assert [p.name for p in tmp_path.glob("step-*.pt")] == ["step-000000002.pt"]
    trainer.close()


@pytest.mark.parametrize(
    ("hook", "instead"),
    [
        ("run_training", "strategy.elastic"),
        ("commit", "strategy.elastic.commit()"),
        ("connect", "strategy.start(options)"),
        ("setup_environment", "strategy.start()"),
        ("announce_failure", "announce_failure(strategy.side_channel(), m)"),
        ("state_dict", "strategy.precision.state_dict()"),
    ],
)
def test_a_plugin_overriding_a_hook_that_is_no_longer_called_fails_at_class_creation(hook, instead):
    with pytest.raises(TypeError) as failure:
        type("OldPlugin", (DataParallelStrategy,), {hook: lambda self, *a: None})
    message = str(failure.value)
    assert f"OldPlugin.{hook} overrides Strategy.{hook}, which distkit no longer calls" in message
    assert instead in message and "docs/plugins.md" in message


def test_an_elastic_capability_runs_the_fit_and_commits_at_each_save_point():
    """A strategy whose ``elastic`` is an Elastic: fit runs its epochs through ``run`` (with
    the run's snapshot) and calls ``commit`` at every checkpoint_every point."""
    events: list[str] = []

    class Recorder(Elastic):
        def run(self, body, snapshot) -> None:
            events.append(f"run with {type(snapshot).__name__}")
            body()

        def commit(self) -> None:
            events.append("commit")

    class ElasticDP(DataParallelStrategy):
        name = "elastic-dp"

        @property
        def elastic(self) -> Elastic | None:
            return Recorder()

    trainer = distkit.Trainer(ElasticDP(), progress=False, batch_size=8, max_epochs=2)
    model = make_mlp()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16), _loss)
    assert events == ["run with RunSnapshot", "commit", "commit"]  # one per epoch
    trainer.close()
