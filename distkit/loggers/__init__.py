"""Loggers: where the trainer sends hyperparameters and metrics (on rank 0 only).

``CSVLogger`` needs nothing; ``TensorBoardLogger`` needs the optional extra
``pip install 'distkit[tensorboard]'`` (checked when the logger is created; importing this module
never imports tensorboard). Anything else (MLflow, W&B, ...) is one short subclass of ``Logger``.
"""

from __future__ import annotations

from distkit.loggers._base import Logger
from distkit.loggers._csv import CSVLogger
from distkit.loggers._tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
