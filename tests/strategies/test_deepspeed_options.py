"""DeepSpeedStrategy's arguments and ``distkit doctor``'s verdict: no DeepSpeed needed (the
strategy imports it only when it starts; the doctor never imports it)."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import pytest
import torch

import distkit
from distkit.errors import ConfigurationError
from distkit.launch._env import LaunchEnv
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.strategies.deepspeed import _doctor
from distkit.strategies.deepspeed._engine_config import engine_config
from tests.support.gates import needs


def test_deepspeed_config_keys_distkit_sets_are_refused_naming_the_distkit_argument():
    with pytest.raises(ConfigurationError, match="grad_accum_steps"):
        distkit.DeepSpeedStrategy(config={"gradient_accumulation_steps": 4})
    with pytest.raises(ConfigurationError, match="precision"):
        distkit.DeepSpeedStrategy(config={"bf16": {"enabled": True}})
    with pytest.raises(ConfigurationError, match=r"torch\.optim"):
        distkit.DeepSpeedStrategy(config={"optimizer": {"type": "Adam"}})
    with pytest.raises(ConfigurationError, match="disagree"):
        distkit.DeepSpeedStrategy(stage=1, config={"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigurationError, match="strategy='ddp'"):
        distkit.DeepSpeedStrategy(stage=0)
    with pytest.raises(ConfigurationError, match="a dict"):
        distkit.DeepSpeedStrategy(config="ds.json")
    assert distkit.DeepSpeedStrategy(config={"zero_optimization": {"stage": 3}}).stage == 3
    assert distkit.DeepSpeedStrategy().stage == 2
    with pytest.raises(ConfigurationError, match=r"checkpoint='dcp'.*'full', 'sharded'"):
        distkit.DeepSpeedStrategy(checkpoint="dcp")
    assert "checkpoint=sharded" in distkit.DeepSpeedStrategy(checkpoint="sharded").agreed_options()


def test_deepspeed_engine_config_keeps_the_users_keys_and_sets_distkits():
    user = {"zero_optimization": {"overlap_comm": True}, "communication_data_type": "fp32"}
    config = engine_config(user, stage=3, precision="bf16")
    assert config["zero_optimization"] == {"overlap_comm": True, "stage": 3}
    assert config["communication_data_type"] == "fp32"
    assert config["managed_gradient_accumulation"] is False
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    assert user == {"zero_optimization": {"overlap_comm": True}, "communication_data_type": "fp32"}


def test_deepspeed_buckets_hold_one_ranks_share_unless_the_user_says():
    """DeepSpeed's 5e8-element default allocates a 1.9 GiB fp32 bucket per rank whatever the
    model (measured: benchmarks/memory.py); distkit sizes it to one rank's share."""

    def buckets(user: Any, parameters: int, world_size: int) -> tuple[int, int]:
        config = engine_config(user, stage=3, precision="32", parameters=parameters,
                               world_size=world_size)["zero_optimization"]  # fmt: skip
        return config["reduce_bucket_size"], config["allgather_bucket_size"]

    assert buckets(None, 50_400_000, 4) == (12_600_064, 12_600_064)  # a multiple of 256:
    assert buckets(None, 50_411_001, 2) == (25_205_504, 25_205_504)  # DeepSpeed asserts one
    assert buckets(None, 50_000, 2) == (2**20, 2**20)  # small models: one bucket
    assert buckets(None, 7 * 10**9, 2) == (500_000_000, 500_000_000)  # DeepSpeed's own
    mine = {"zero_optimization": {"reduce_bucket_size": 123}}
    assert buckets(mine, 50_400_000, 4) == (123, 12_600_064)


def _one_step_of_a_model_larger_than_the_smallest_bucket() -> int:
    # (one step on random inputs, alike on every rank: meant so)
    strategy = distkit.DeepSpeedStrategy(stage=2)
    with distkit.Runtime(strategy, seed=0, same_data_on_every_rank=True) as rt:
        net = torch.nn.Linear(1501, 1499)  # 2,251,498 parameters: a share of 1,125,749 (odd)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        rt.backward(model(torch.randn(4, 1501)).square().mean())
        optimizer.step()
        bucket: int = rt.strategy.engine_of_model(net).engine.zero_reduce_bucket_size()
        return bucket


@needs("deepspeed")
def test_deepspeed_accepts_the_bucket_distkit_sizes(run_on_ranks):
    """DeepSpeed asserts its all-gather bucket is a multiple of its alignment: an odd share
    failed at set-up (the memory table found it); distkit rounds it up to a multiple of 256."""
    for bucket in run_on_ranks(_one_step_of_a_model_larger_than_the_smallest_bucket, world_size=2):
        assert bucket == 1_125_888  # 4398 x 256


def _machine() -> MachineFacts:
    return MachineFacts("python3", "2.13.0", 0, True, False, True, LaunchEnv(launcher="python"))


LAUNCHER = StrategyReport("deepspeed", True, "backend gloo on CPU")


def test_doctor_says_deepspeed_is_missing_and_how_to_install_it(monkeypatch):
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    report = _doctor.verdict("deepspeed", _machine(), LAUNCHER)
    assert not report.usable and "not installed" in report.summary
    assert report.fix is not None and "distkit[deepspeed]" in report.fix


@pytest.mark.parametrize("compiler", ["/usr/bin/c++", None])
def test_doctor_reports_the_deepspeed_version_and_the_compiler(monkeypatch, compiler):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.8")
    monkeypatch.setattr(_doctor.shutil, "which", lambda name: compiler)
    report = _doctor.verdict("deepspeed", _machine(), LAUNCHER)
    assert report.usable and report.summary.startswith("deepspeed 0.19.8; backend gloo")
    assert report.details["c++ compiler"] == compiler
    assert ("no C++ compiler" in report.summary) is (compiler is None)


def test_strategies_with_options_pickle_for_spawned_processes():
    """distkit.spawn and the test harness send strategy instances to child processes."""
    import pickle

    from torch.distributed.fsdp import CPUOffloadPolicy

    for strategy in (
        distkit.DeepSpeedStrategy(stage=3, config={"zero_optimization": {"overlap_comm": True}}),
        distkit.FSDPStrategy(replicate=2, offload_policy=CPUOffloadPolicy(pin_memory=False)),
    ):
        copy = pickle.loads(pickle.dumps(strategy))
        assert type(copy) is type(strategy) and copy.agreed_options() == strategy.agreed_options()


@needs("deepspeed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_deepspeed_fp16_on_the_cpu_is_refused_leaving_no_group_or_local_rank_behind():
    """DeepSpeed's CPU accelerator has no fp16: refused once the strategy has joined its group
    and set LOCAL_RANK for DeepSpeed, and both are released with the error."""
    from distkit.errors import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError, match="needs CUDA"):
        distkit.Trainer(distkit.DeepSpeedStrategy(stage=2), precision="fp16")
    assert not torch.distributed.is_initialized()
    assert "LOCAL_RANK" not in os.environ


@needs("deepspeed")
def test_deepspeed_config_key_it_does_not_read_is_refused_naming_the_nearest():
    """A misspelt zero_optimization: DeepSpeed ignored it and trained at its default stage,
    without a word. Refused at the set-up, before anything trains."""
    strategy = distkit.DeepSpeedStrategy(config={"zero_optimisation": {"stage": 3}})
    with distkit.Runtime(strategy) as rt:
        model = torch.nn.Linear(3, 2)
        with pytest.raises(ConfigurationError, match="Did you mean 'zero_optimization'"):
            rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not torch.distributed.is_initialized()
