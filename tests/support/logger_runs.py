"""A small fit that feeds one logger, for the tracker tests (W&B, MLflow)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import distkit
from distkit.loggers import Logger
from tests.support.workloads import make_dataset, make_mlp


def fit_with_logger(
    logger: Logger, *, strategy: str = "dp", fail_at: BaseException | None = None
) -> Any:
    """One epoch of 6 steps (24 samples, batch 4), logging every 2 steps; ``fail_at`` is
    raised from a callback at step 3 (a failed or interrupted fit)."""

    class Fail(distkit.Callback):
        def on_train_step_end(self, trainer: Any, logs: Any) -> None:
            if logs["step"] == 3 and fail_at is not None:
                raise fail_at

    trainer = distkit.Trainer(strategy, batch_size=4, max_epochs=1, progress=False,
                              log_every_n_steps=2, loggers=[logger],
                              callbacks=[Fail()])  # fmt: skip
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return trainer.fit(model, optimizer, make_dataset(24), loss_fn=nn.functional.cross_entropy)
