"""Strategy names: lazy resolution, helpful errors on typos, and "auto" following the launcher."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import distkit
from distkit._env import LaunchEnv
from distkit.registry import auto_strategy_name, resolve_strategy_class
from distkit.strategies.ddp import DDPStrategy
from distkit.strategies.dp import DataParallelStrategy

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
                not _HAS_HOROVOD_STRATEGY, reason="distkit/strategies/horovod.py not written yet"
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
        ("mpirun", "horovod"),
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
