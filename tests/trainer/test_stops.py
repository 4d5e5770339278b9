"""Where a fit stops: ``max_steps`` or ``should_stop`` on an epoch's last step still closes
that epoch (its validation, history record, epoch hooks and checkpoint), exactly as the same
run with no stop there; a stop with data left does not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit import checkpoint as ckpt
from distkit.callbacks import Callback

pytestmark = pytest.mark.timeout(120)

#: 64 samples in batches of 4: 16 steps an epoch
SAMPLES, BATCH, STEPS_PER_EPOCH = 64, 4, 16


class _Seen(Callback):
    """What the hooks saw; with ``stop_at``, asks to stop after that global step."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.epoch_ends: list[int] = []  # the epoch of each on_epoch_end
        self.validations = 0

    def on_train_step_end(self, trainer: Any, logs: Any) -> None:
        if self.stop_at is not None and logs["step"] == self.stop_at:
            trainer.should_stop = True

    def on_validation_end(self, trainer: Any, metrics: Any) -> None:
        self.validations += 1

    def on_epoch_end(self, trainer: Any, record: Any) -> None:
        self.epoch_ends.append(int(record["epoch"]))


def _data(seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 3, generator=generator, dtype=torch.float64)
    return TensorDataset(x, torch.arange(SAMPLES) % 2)


def _fit(seen: _Seen, folder: Any = None, **settings: Any) -> tuple[distkit.FitResult, Any]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    trainer = distkit.Trainer(
        "dp", batch_size=BATCH, progress=False, shuffle=False, callbacks=[seen],
        checkpoint_dir=folder, **settings,
    )  # fmt: skip
    result = trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _data(0),
        val_data=_data(1),
        loss_fn=nn.functional.cross_entropy,
    )
    state = trainer.full_state_dict()
    trainer.close()
    return result, state


@pytest.mark.parametrize("epochs_trained", [1, 3])
def test_max_steps_on_an_epochs_last_step_gives_that_epoch_its_end(epochs_trained, tmp_path):
    """max_steps=16 (or 48) with 16 steps an epoch: each trained epoch gets its validation,
    record and on_epoch_end, the same as max_epochs alone gives. Before, the last epoch got
    none of them (max_steps=16: no validation at all), and the final validation a user read
    was the previous epoch's."""
    steps = epochs_trained * STEPS_PER_EPOCH
    seen = _Seen()
    stopped, state = _fit(seen, tmp_path / "a", max_epochs=3, max_steps=steps)
    alone = _Seen()
    whole, whole_state = _fit(alone, tmp_path / "b", max_epochs=epochs_trained)
    assert len(stopped.history) == epochs_trained
    assert seen.epoch_ends == list(range(epochs_trained)) == alone.epoch_ends
    assert seen.validations == epochs_trained == len(stopped.validations)
    assert stopped.history[-1]["val_loss"] == whole.history[-1]["val_loss"]
    assert [v["step"] for v in stopped.validations] == [v["step"] for v in whole.validations]
    assert all(torch.equal(state[k], whole_state[k]) for k in whole_state)
    # the folder holds the epoch's end: a later fit from it has nothing left to run
    (last,) = ckpt.CheckpointFolder(tmp_path / "a").checkpoints()[-1:]
    assert int(ckpt.load(last)["progress"]["global_step"]) == steps
    again = _Seen()
    resumed, _ = _fit(again, tmp_path / "a", max_epochs=3, max_steps=steps, resume="auto")
    assert again.epoch_ends == [] and again.validations == 0
    assert len(resumed.history) == epochs_trained


def test_should_stop_on_an_epochs_last_step_closes_that_epoch_then_stops():
    seen = _Seen(stop_at=STEPS_PER_EPOCH)
    result, _ = _fit(seen, max_epochs=3)
    assert result.stopped_early
    assert seen.epoch_ends == [0] and len(result.history) == 1 and seen.validations == 1


def test_max_steps_with_data_left_stops_mid_epoch_without_its_end():
    seen = _Seen()
    result, _ = _fit(seen, max_epochs=3, max_steps=STEPS_PER_EPOCH + 5)
    assert seen.epoch_ends == [0] and len(result.history) == 1
    assert seen.validations == 1  # the first epoch's; the second never ended
