"""LearningRateMonitor: the learning rate of every parameter group, to the loggers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from distkit.callbacks._base import Callback

if TYPE_CHECKING:
    from distkit.trainer import Trainer


class LearningRateMonitor(Callback):
    """Log each parameter group's learning rate every ``log_every_n_steps`` steps.

    The values are named ``lr`` for a single group and ``lr-group<i>`` for several; they
    are host values (no synchronisation). The first group's lr is also in every step's
    ``logs["lr"]``.
    """

    stops_training = False

    @override
    def on_train_step_end(self, trainer: Trainer, logs: Mapping[str, Any]) -> None:
        step = int(logs["step"])
        if step % trainer.log_every_n_steps and step != 1:
            return
        groups = trainer.optimizer.param_groups if trainer.optimizer is not None else []
        if len(groups) == 1:
            values = {"lr": float(groups[0]["lr"])}
        else:
            values = {f"lr-group{i}": float(g["lr"]) for i, g in enumerate(groups)}
        trainer.log_metrics(values, step=step)
