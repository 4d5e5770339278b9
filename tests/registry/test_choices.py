"""The registry's answers reach the messages below it as a value, not through a global.

A strategy from ``make_strategy`` (a name, or an instance the user passed) holds the
registry's answers, registered strategies included; one built by hand holds the built-in
table's, which must stay the registry's own answers for the built-in strategies.
"""

from __future__ import annotations

import typing

import pytest
import torch

import distkit
import distkit.registry
from distkit.errors import ConfigurationError
from distkit.launch import LaunchRequest
from distkit.launch._choices import BUILTIN_CHOICES, native_alternative
from distkit.launch._env import LaunchEnv, Launcher
from distkit.registry import DEFAULT_CHOICES, RegistryChoices, StrategyRegistry, make_strategy
from distkit.strategies._placement import Placement
from distkit.strategies.ddp import DDPStrategy
from distkit.strategies.dp import DataParallelStrategy
from distkit.strategies.horovod._horovodrun import horovod_has_mpi

pytestmark = pytest.mark.timeout(60)


class KeeperStrategy(DDPStrategy):
    """A registered strategy that keeps a model where the user placed it."""

    name = "keeper"
    placement_refusal = None


def test_builtin_choices_are_the_registry_answers_for_the_builtin_strategies():
    registry = RegistryChoices(StrategyRegistry())
    for launcher in typing.get_args(Launcher):
        if launcher == "mpirun" and horovod_has_mpi():
            continue  # the registry picks horovod there; a table cannot know the build
        env = LaunchEnv(launcher=launcher)
        assert BUILTIN_CHOICES.auto_name(env) == registry.auto_name(env), launcher
    assert BUILTIN_CHOICES.keeping_placed_models() == registry.keeping_placed_models()
    assert BUILTIN_CHOICES.multi_process() == registry.multi_process()


def test_make_strategy_hands_the_registry_answers_to_every_strategy(monkeypatch):
    monkeypatch.setattr(distkit.registry, "DEFAULT_REGISTRY", StrategyRegistry())
    distkit.register_strategy("keeper", KeeperStrategy)
    made = make_strategy("dp")
    given = make_strategy(DataParallelStrategy())
    bare = DataParallelStrategy()
    assert made.choices is DEFAULT_CHOICES and given.choices is DEFAULT_CHOICES
    assert bare.choices is BUILTIN_CHOICES

    def refusal(choices: typing.Any) -> str:
        placed = Placement(
            (torch.device("cuda", 0), torch.device("cuda", 1)), torch.device("cuda", 0)
        )
        with pytest.raises(ConfigurationError) as caught:
            placed.check("dp", DataParallelStrategy.placement_refusal, choices=choices)
        return str(caught.value)

    # the registered keeper is named where the registry answers, not by a hand-built strategy
    assert "strategy='ddp' or strategy='horovod' or strategy='keeper'" in refusal(made.choices)
    assert "strategy='keeper'" not in refusal(bare.choices)
    assert native_alternative(made.choices) == "ddp"


def test_the_runtime_strategy_holds_the_registry_answers():
    with distkit.Runtime(strategy=DataParallelStrategy()) as rt:
        assert rt.strategy.choices is DEFAULT_CHOICES


def test_a_launch_request_and_the_doctor_take_the_choices_they_are_given():
    class Only:
        def auto_name(self, env: LaunchEnv) -> str:
            return "only"

        def keeping_placed_models(self) -> list[str]:
            return ["only"]

        def multi_process(self) -> list[str]:
            return ["only"]

    request = LaunchRequest("dp", "train.py", nproc_per_node=2, choices=Only())
    with pytest.raises(
        ConfigurationError, match=r"use --strategy only, e.g. distkit run --strategy only"
    ):
        DataParallelStrategy.launch_command(request, python="python", tools={})
    assert request == LaunchRequest("dp", "train.py", nproc_per_node=2)  # not compared
    from distkit.launch.diagnosis import MachineFacts
    from distkit.strategies.apex import ApexStrategy

    facts = MachineFacts("python", "2.13.0", 0, True, False, True, LaunchEnv(), choices=Only())
    report = ApexStrategy.diagnose(facts)
    assert not report.usable and report.fix is not None
    if report.fix.startswith("none here"):  # no CUDA: the verdict names what runs instead
        assert "distkit run --strategy only" in report.fix
