"""RunSnapshot: what Horovod elastic saves at a commit and restores after a failed step."""

from __future__ import annotations

import torch
from torch import nn

import distkit
from distkit.callbacks import EarlyStopping
from distkit.callbacks._list import CallbackList
from distkit.trainer._fit_state import FitState
from distkit.trainer._snapshot import RunSnapshot
from tests.support.workloads import make_mlp, max_abs_diff, state_of


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()


def test_snapshot_restore_brings_everything_back_and_keeps_shared_objects():
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, optimizer)  # some optimizer state to keep
    stopper = EarlyStopping(monitor="train_loss")
    state = FitState(epoch=1, position=8, global_step=3, history=[{"epoch": 0.0}])
    snapshot = RunSnapshot(model, optimizer, None, state, CallbackList([stopper]))
    shared = optimizer.state  # a wrapper (Horovod's DistributedOptimizer) holds this object
    snapshot.save()
    saved_weights, saved_step = state_of(model), float(optimizer.state_dict()["state"][0]["step"])

    _step(model, optimizer)  # a step after the commit, then a failure
    state.global_step, state.position, stopper.wait = 4, 12, 2
    snapshot.restore()

    assert max_abs_diff(state_of(model), saved_weights) == 0.0
    assert optimizer.state is shared  # restored into the same object, not a new one
    assert optimizer.state_dict()["state"][0]["step"] == saved_step
    assert (state.global_step, state.position, state.epoch) == (3, 8, 1)
    assert stopper.wait == 0


def test_snapshot_and_checkpoint_carry_the_same_fit_state():
    """One projection of FitState for both: the snapshot once carried fewer fields than a
    checkpoint (no local_position: a restore left a rank's place in its own stream where
    the failed step had moved it)."""
    state = FitState(
        epoch=2,
        position=16,
        local_position=8,
        global_step=6,
        skipped_steps=1,
        loss_sum=3.5,
        samples=8,
        history=[{"epoch": 0.0}],
        validations=[{"step": 4.0}],
    )
    snapshot = RunSnapshot(
        make_mlp(),
        torch.optim.SGD(make_mlp().parameters(), lr=0.1),
        None,
        state,
        CallbackList(None),
    )
    saved = snapshot.capture()
    assert saved["fit"] == state.shared_state() and saved["local"] == state.rank_state()
    snapshot.save()
    state.position, state.local_position, state.samples, state.loss_sum = 24, 12, 12, 5.0
    state.history.append({"epoch": 1.0})
    snapshot.restore()
    assert (state.position, state.local_position, state.samples, state.loss_sum) == (16, 8, 8, 3.5)
    assert state.history == [{"epoch": 0.0}]
    other = FitState()
    other.load_shared_state(saved["fit"])
    other.load_rank_state(None)  # another rank's view after a sync
    assert other.shared_state() == state.shared_state()
    assert (other.local_position, other.samples, other.loss_sum) == (None, 0, 0.0)


def test_snapshot_restore_before_any_commit_changes_nothing():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = state_of(model)
    RunSnapshot(model, optimizer, None, FitState(), CallbackList(None)).restore()
    assert max_abs_diff(state_of(model), before) == 0.0


def test_snapshot_sync_on_one_process_keeps_the_state_and_saves_it():
    trainer = distkit.Trainer("dp", progress=False)
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = FitState(global_step=5)
    snapshot = RunSnapshot(model, optimizer, None, state, CallbackList(None))
    snapshot.sync(trainer.strategy)
    state.global_step = 9
    snapshot.restore()
    assert state.global_step == 5
