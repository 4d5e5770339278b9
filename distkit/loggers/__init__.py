"""Loggers: where the trainer sends hyperparameters and metrics (on rank 0 only).

``CSVLogger`` needs nothing. ``TensorBoardLogger``, ``WandbLogger`` and ``MLflowLogger`` need an
optional extra each: ``pip install 'distkit[tensorboard]'``, ``'distkit[wandb]'``,
``'distkit[mlflow]'`` (checked when the logger is created; importing this module imports none of
them). Any other tracker is one short subclass of ``Logger``.

A tracker that is down costs a fit one bounded wait, not the fit: ``MLflowLogger`` waits for a
call at most its ``timeout``, ``WandbLogger`` for ``wandb.init`` at most W&B's ``init_timeout``
(distkit's default: 30 s), and a tracker found unavailable raises ``TrackerUnavailableError``
at once until ``finalize``, which the trainer reports once.
"""

from __future__ import annotations

from distkit.loggers._base import Logger
from distkit.loggers._csv import CSVLogger
from distkit.loggers._mlflow import MLflowLogger
from distkit.loggers._tensorboard import TensorBoardLogger
from distkit.loggers._tracker import TrackerUnavailableError
from distkit.loggers._wandb import WandbLogger

__all__ = [
    "CSVLogger",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "TrackerUnavailableError",
    "WandbLogger",
]
