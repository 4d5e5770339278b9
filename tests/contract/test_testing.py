"""distkit.testing, the contract suite plugin authors run: it catches broken strategies.

The broken strategies here are real DDP subclasses on real gloo processes, each broken in one
documented way; tests/contract/test_strategy_contract.py runs the same promises on every backend.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import unittest
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from typing_extensions import override

import distkit
import distkit.testing
from distkit.strategies.capabilities import StateIO
from distkit.strategies.ddp import DDPStrategy

pytestmark = pytest.mark.timeout(180)


class _CarelessDDP(DDPStrategy):
    """Breaks three promises: a "mean" that sums, a no_sync that syncs, an unwrap that raises."""

    name = "careless-ddp"

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return super()._all_reduce(tensor, "sum")

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError("unwrap is not written yet")


class _SummingDDP(DDPStrategy):
    """Sums gradients over ranks instead of averaging them (the loss scaled by world_size)."""

    name = "summing-ddp"

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        super().backward(loss * self.world_size, optimizer)


class _NarrowingDDP(DDPStrategy):
    """Trains a float64 model in float32 (casts it at set-up), as ZeRO's float32 master
    weights would: the float32 result is close, and must not pass for float64's."""

    name = "narrowing-ddp"

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model.float()  # and its inputs, as a mixed-precision engine casts them
        model.register_forward_pre_hook(lambda _, args: tuple(a.float() for a in args))
        return super()._setup_model_and_optimizer(model, optimizer)


class _NoOptimizerStateIO(StateIO):
    """Writes the optimizer's hyperparameters but not its state (SGD's momentum buffers)."""

    @override
    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        state = super().optimizer_state_dict(optimizer, rank0_only=rank0_only)
        return {**state, "state": {}} if state else state


class _ForgetfulDDP(DDPStrategy):
    """Saves optimizers without their state: a resumed run starts its momentum afresh."""

    name = "forgetful-ddp"

    @property
    @override
    def state_io(self) -> StateIO:
        return _NoOptimizerStateIO(self)


class _StuckUnwrapDDP(DDPStrategy):
    """Rank 1 never returns from unwrap(): the launch hangs after the first promises."""

    name = "stuck-ddp"

    def unwrap(self, model: nn.Module) -> nn.Module:
        if self.rank == 1:
            time.sleep(3600)
        return super().unwrap(model)


def _failure(run: distkit.testing.ContractRun, promise: str) -> str:
    with pytest.raises(AssertionError) as info:
        run.check(promise)
    return str(info.value)


def test_testing_public_names_are_pinned():
    assert distkit.testing.__all__ == [
        "LAUNCHERS",
        "PROMISES",
        "ContractRun",
        "PromiseSkipped",
        "check_promise",
        "run_on_ranks",
        "run_promises",
    ]
    assert distkit.testing.PROMISES == (
        "topology",
        "collectives",
        "main_process_first",
        "identical_initial_weights",
        "unwrap",
        "no_sync_is_local",
        "mean_gradients",
        "runtime_world_size_invariance",
        "runtime_accumulation",
        "runtime_clipping",
        "runtime_two_models",
        "runtime_checkpoint_round_trip",
        "world_size_invariance",
        "checkpoint_round_trip",
        "clipping",
        "stop_together",
        "callback_state_round_trip",
    )


def test_testing_is_not_imported_by_distkit_and_needs_no_pytest():
    code = (
        "import sys; import distkit; assert 'distkit.testing' not in sys.modules; "
        "sys.modules['pytest'] = None; import distkit.testing; "
        "assert 'pytest' not in [m for m, v in sys.modules.items() if v is not None]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_testing_names_each_broken_promise_and_keeps_checking_the_others():
    run = distkit.testing.run_promises(
        _CarelessDDP, ["topology", "collectives", "unwrap", "no_sync_is_local", "mean_gradients"]
    )
    run.check("topology")
    run.check("mean_gradients")  # no_sync off changes when gradients are averaged, not the mean
    collectives = _failure(run, "collectives")
    assert "strategy 'careless-ddp' fails promise 'collectives'" in collectives
    assert "all_reduce (mean) gave [3.0, 4.0]; expected [1.5, 2.0]" in collectives
    no_sync = _failure(run, "no_sync_is_local")
    assert "inside no_sync" in no_sync and "they were all-reduced" in no_sync
    unwrap = _failure(run, "unwrap")
    assert "rank 0 raised" in unwrap and "NotImplementedError: unwrap is not written" in unwrap


def test_testing_catches_summed_gradients_in_the_trainer_and_in_a_user_loop():
    promises = ["mean_gradients", "world_size_invariance", "runtime_world_size_invariance"]
    run = distkit.testing.run_promises(_SummingDDP, promises)
    assert "expected the mean over ranks" in _failure(run, "mean_gradients")
    invariance = _failure(run, "world_size_invariance")
    assert "2 processes at batch size 4 end" in invariance
    assert "from one process ('dp') at batch size 8 (allowed 1e-09 in torch.float64)" in invariance
    loop = _failure(run, "runtime_world_size_invariance")
    assert "a user loop at 2 process(es) with batch size 4 ends" in loop
    assert "from one process ('dp') at batch size 8 (allowed 1e-09 in torch.float64)" in loop


def test_testing_catches_a_strategy_that_trains_a_float64_model_in_float32():
    run = distkit.testing.run_promises(_NarrowingDDP, ["world_size_invariance"])
    message = _failure(run, "world_size_invariance")
    assert (
        "the model was given in torch.float64 and its trained weights came back in "
        "torch.float32: the strategy changed the model's dtype" in message
    )


def test_testing_catches_a_user_loop_checkpoint_without_the_optimizer_state():
    run = distkit.testing.run_promises(_ForgetfulDDP, ["runtime_checkpoint_round_trip"])
    message = _failure(run, "runtime_checkpoint_round_trip")
    assert "rt.save'd after 2 steps, then rt.load'ed in a new Runtime and finished" in message
    assert "away from the uninterrupted loop" in message


def test_testing_a_hung_launch_still_reports_the_promises_that_finished():
    run = distkit.testing.run_promises(
        _StuckUnwrapDDP, ["topology", "unwrap", "collectives"], timeout=10
    )
    run.check("topology")
    for promise in ("unwrap", "collectives"):
        message = _failure(run, promise)
        assert "reported no result" in message and "timed out after 10" in message


@pytest.mark.parametrize("promise", ["world_size_invariance", "runtime_world_size_invariance"])
def test_testing_single_process_strategy_skips_world_size_invariance_with_the_reason(promise):
    with pytest.raises(unittest.SkipTest, match="no other world size to compare with"):
        distkit.testing.check_promise(promise, "dp")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"promise": "mean_gradient"}, "unknown promise 'mean_gradient'. Allowed: topology,"),
        ({"launcher": "mpirun"}, "unknown launcher 'mpirun'. Allowed: processes, horovodrun"),
        ({"strategy": "dp", "world_size": 2}, "runs as a single python process"),
        ({"world_size": 0}, "world_size=0; allowed: an int >= 1"),
        (
            {"dtype": torch.float16},
            "dtype=torch.float16: the training promises train in torch.float64, torch.float32",
        ),
    ],
)
def test_testing_refuses_bad_arguments_before_launching(kwargs, words):
    arguments = {"promise": "topology", "strategy": "ddp", **kwargs}
    with pytest.raises(distkit.ConfigurationError, match=words.replace("(", r"\(")):
        distkit.testing.check_promise(**arguments)


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_testing_check_promise_passes_for_a_kept_promise():
    distkit.testing.check_promise("unwrap", "ddp", rank_setup=_nothing)
