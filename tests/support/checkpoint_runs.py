"""The training runs the checkpoint tests resume and port between strategies.

Shared by tests/checkpoint/test_checkpoint.py (the portability matrix) and
tests/strategies/test_horovod.py (the same checkpoints to and from Horovod), whose horovodrun
ranks call :func:`train_run` by its module path. The runs train in float64
(tests/support/exactness.py), so a resumed run equals the uninterrupted one within 1e-9.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from tests.support.exactness import DTYPE
from tests.support.fakes import use_fake_apex
from tests.support.workloads import make_dataset


def dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3)).to(DTYPE)


def train_run(strategy: str, batch_size: int, folder: str | None = None, *, max_steps=None,
              resume=None, every=3, epochs: int = 2, model: str = "dropout") -> dict:  # fmt: skip
    """Train 2 epochs on 64 samples (8 steps per epoch at global batch 8)."""
    if strategy == "apex":
        import distkit.strategies.apex as apex_strategy

        apex_strategy._require_cuda = lambda choices: None  # FAKE CUDA (fake apex is on the path)
    trainer = distkit.Trainer(
        strategy, batch_size=batch_size, max_epochs=epochs, seed=11, progress=False,
        checkpoint_dir=folder, checkpoint_every=every, max_steps=max_steps, resume=resume,
    )  # fmt: skip
    net = dropout_model() if model == "dropout" else plain_model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    data = make_dataset(64, dtype=DTYPE)
    result = trainer.fit(net, optimizer, data, loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(),  # full tensors whatever the strategy (fsdp shards)
           "history": result.history, "rank": trainer.rank}  # fmt: skip
    trainer.close()
    return out


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(DTYPE)


def on_rank(strategy: str, *args, **kwargs) -> dict:
    if strategy == "apex":
        with use_fake_apex("legacy"):
            return train_run(strategy, *args, **kwargs)
    return train_run(strategy, *args, **kwargs)


def resume_each(strategy: str, batch: int, paths: list[str]) -> list[dict]:
    """:func:`on_rank` resumed from each of ``paths`` in turn, in this one process (a
    Trainer after another: one start of the ranks for all of them)."""
    return [on_rank(strategy, batch, None, resume=path, model="plain") for path in paths]


def make_source_checkpoint(strategy: str, world: int, batch: int, folder: Path, run) -> Path:
    run(partial(on_rank, max_steps=5, every=5, model="plain"), strategy, batch, str(folder),
        world_size=world)  # fmt: skip
    path = ckpt.CheckpointFolder(folder).latest()
    assert path is not None
    return path
