"""Strategy names: lazy resolution, helpful errors on typos, and "auto" following the launcher."""

from __future__ import annotations

import importlib.util
import typing

import pytest
import torch

import distkit
import distkit.registry
from distkit.launch._env import LaunchEnv, Launcher
from distkit.launchers import LauncherFamily
from distkit.registry import (
    BUILTIN_STRATEGIES,
    StrategyRegistry,
    auto_strategy_name,
    resolve_strategy_class,
)
from distkit.strategies.ddp import DDPStrategy
from distkit.strategies.dp import DataParallelStrategy
from distkit.strategies.horovod._horovodrun import horovod_has_mpi

pytestmark = pytest.mark.timeout(60)

_HAS_HOROVOD_STRATEGY = importlib.util.find_spec("distkit.strategies.horovod") is not None


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("ddpp", "ddp"),
        pytest.param(
            "horvod",
            "horovod",
            marks=pytest.mark.skipif(
                not _HAS_HOROVOD_STRATEGY,
                reason="distkit/strategies/horovod/ not written yet",
            ),
        ),
    ],
)
def test_resolve_strategy_class_typo_suggests_closest_name(typo, suggestion):
    with pytest.raises(distkit.UnknownStrategyError) as info:
        resolve_strategy_class(typo)

    message = str(info.value)
    assert repr(typo) in message
    assert f"Did you mean {suggestion!r}?" in message
    available = message.split("Available:", 1)[1]
    listed = [name.strip() for name in available.split(",")]
    assert set(distkit.available_strategies()) <= set(listed)
    assert "ddp" in listed and "dp" in listed


def test_unknown_strategy_error_is_a_value_error():
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        resolve_strategy_class("nope")


def test_resolve_strategy_class_far_name_has_no_suggestion():
    with pytest.raises(distkit.UnknownStrategyError) as info:
        resolve_strategy_class("tensorflow")

    assert "Did you mean" not in str(info.value)
    assert "Available:" in str(info.value)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ddp", DDPStrategy),
        ("DDP", DDPStrategy),
        (" Ddp ", DDPStrategy),
        ("dp", DataParallelStrategy),
        ("DP", DataParallelStrategy),
    ],
)
def test_resolve_strategy_class_is_case_insensitive(name, expected):
    assert resolve_strategy_class(name) is expected


@pytest.mark.parametrize("value", [None, 3, DDPStrategy])
def test_resolve_strategy_class_non_string_raises_unknown_strategy(value):
    with pytest.raises(distkit.UnknownStrategyError, match="must be a name") as info:
        resolve_strategy_class(value)  # type: ignore[arg-type]

    assert type(value).__name__ in str(info.value)
    assert "Available:" in str(info.value)


@pytest.mark.parametrize(
    ("launcher", "expected"),
    [
        ("torchrun", "ddp"),
        ("torch.distributed.launch", "ddp"),
        ("horovodrun", "horovod"),
        ("mpirun", "horovod" if horovod_has_mpi() else "ddp"),
        ("srun", "ddp"),
        ("none", "dp"),
    ],
)
def test_auto_strategy_name_follows_launcher(launcher, expected):
    assert auto_strategy_name(LaunchEnv(launcher=launcher)) == expected


def test_available_strategies_lists_sorted_registered_names():
    names = distkit.available_strategies()

    assert "ddp" in names and "dp" in names
    assert "auto" not in names
    assert names == sorted(names)
    for name in names:
        assert resolve_strategy_class(name).name == name


def test_trainer_unknown_strategy_raises():
    with pytest.raises(distkit.UnknownStrategyError, match="unknown strategy 'nope'"):
        distkit.Trainer("nope", progress=False)


def test_trainer_dp_strategy_runs_in_process_without_launcher():
    with distkit.Trainer("dp", progress=False) as trainer:
        assert isinstance(trainer.strategy, DataParallelStrategy)
        assert (trainer.rank, trainer.world_size, trainer.is_main) == (0, 1, True)
        expected_device = "cuda" if torch.cuda.is_available() else "cpu"
        assert trainer.device.type == expected_device


# ---------------------------------------------------------------- the classes carry their facts
def test_builtin_classes_carry_their_name_and_launcher_family():
    for name in BUILTIN_STRATEGIES:
        cls = resolve_strategy_class(name)
        assert cls.name == name
        assert isinstance(cls.launcher, LauncherFamily), name


@pytest.mark.parametrize("launcher", typing.get_args(Launcher))
def test_auto_exactly_one_builtin_candidate_recognises_each_launcher(launcher):
    env = LaunchEnv(launcher=launcher)
    registry = StrategyRegistry(entry_point_group=None)
    fits = [name for name, cls in registry.auto_candidates() if cls.launcher.recognises(env)]
    if not fits:  # no family's own launcher (mpirun without an MPI Horovod): who runs under it
        fits = [name for name, cls in registry.auto_candidates() if cls.launcher.accepts(env)]
    assert fits == [auto_strategy_name(env)]


# ---------------------------------------------------------------- explicit registration
class SerialStrategy(DataParallelStrategy):
    """A single-process strategy under a name of its own (registration tests)."""

    name = "serial"
    auto_select = False


class NotAStrategy:
    name = "serial"


@pytest.fixture
def registry():
    return StrategyRegistry(entry_point_group=None)


def test_register_class_resolves_and_is_listed(registry):
    registry.register("serial", SerialStrategy)

    assert registry.resolve(" Serial ") is SerialStrategy
    assert "serial" in registry.names() and registry.origin("serial") == "register_strategy()"
    registry.register("serial", SerialStrategy)  # the same again: nothing happens
    registry.unregister("serial")
    with pytest.raises(distkit.UnknownStrategyError):
        registry.resolve("serial")


def test_register_string_target_is_imported_on_first_use(registry):
    registry.register("serial", "tests.registry.test_registry:SerialStrategy")

    assert registry.resolve("serial") is SerialStrategy


def test_register_broken_string_target_fails_on_use_naming_the_registration(registry):
    registry.register("serial", "tests.no_such_module:SerialStrategy")

    with pytest.raises(distkit.StrategyPluginError, match=r"register_strategy\('serial'") as info:
        registry.resolve("serial")
    assert "ModuleNotFoundError" in str(info.value) and "\n" not in str(info.value)
    assert "serial" not in registry.load_all()  # left out; the others still load
    assert "ddp" in registry.load_all()


@pytest.mark.parametrize(
    ("name", "strategy", "message"),
    [
        ("ddp", SerialStrategy, "built-in strategy"),
        ("auto", SerialStrategy, "choice by launcher"),
        ("Serial", SerialStrategy, "not a valid strategy name"),
        ("serial", NotAStrategy, "not a distkit.Strategy subclass"),
        ("other", SerialStrategy, "set name = 'other'"),
        ("serial", "no_colon", "not 'module:Class'"),
    ],
)
def test_register_refuses_what_cannot_work(registry, name, strategy, message):
    with pytest.raises(distkit.ConfigurationError, match=message):
        registry.register(name, strategy)


def test_register_another_class_under_a_taken_name_needs_replace(registry):
    class OtherSerial(SerialStrategy):
        pass

    registry.register("serial", SerialStrategy)
    with pytest.raises(distkit.ConfigurationError, match="replace=True"):
        registry.register("serial", OtherSerial)
    registry.register("serial", OtherSerial, replace=True)
    assert registry.resolve("serial") is OtherSerial


def test_register_strategy_makes_the_trainer_build_it(monkeypatch):
    monkeypatch.setattr(distkit.registry, "DEFAULT_REGISTRY", StrategyRegistry())
    distkit.register_strategy("serial", SerialStrategy)

    assert "serial" in distkit.available_strategies()
    with distkit.Trainer("serial", progress=False) as trainer:
        assert type(trainer.strategy) is SerialStrategy
