"""Callbacks: user code between the steps of :meth:`distkit.Trainer.fit`, on every rank.

Subclass :class:`Callback` (also ``distkit.Callback``) or use a built-in:
:class:`EarlyStopping`, :class:`BestCheckpoint`, :class:`LearningRateMonitor`,
:class:`EMA`.
"""

from distkit.callbacks._base import Callback
from distkit.callbacks.best_checkpoint import BestCheckpoint
from distkit.callbacks.early_stopping import EarlyStopping
from distkit.callbacks.ema import EMA
from distkit.callbacks.lr_monitor import LearningRateMonitor

__all__ = ["EMA", "BestCheckpoint", "Callback", "EarlyStopping", "LearningRateMonitor"]
