"""distkit: one PyTorch training script, any data-parallel backend.

>>> import distkit
>>> trainer = distkit.Trainer(strategy="ddp", batch_size=32)  # doctest: +SKIP

Importing distkit imports no backend library (Horovod, apex) and changes nothing.
"""

from distkit.errors import (
    ConfigurationError,
    DistkitError,
    LauncherMismatchError,
    MissingDependencyError,
    UnknownStrategyError,
    UnsupportedFeatureError,
)
from distkit.metrics import Accuracy, ConfusionMatrix, MeanIoU, Metric
from distkit.registry import available_strategies
from distkit.strategies.base import Strategy, Topology, TrainOptions
from distkit.syncbn import GlobalBatchNorm
from distkit.trainer import FitResult, Trainer

__version__ = "0.1.0"

__all__ = [
    "Accuracy",
    "ConfigurationError",
    "ConfusionMatrix",
    "DistkitError",
    "FitResult",
    "GlobalBatchNorm",
    "LauncherMismatchError",
    "MeanIoU",
    "Metric",
    "MissingDependencyError",
    "Strategy",
    "Topology",
    "TrainOptions",
    "Trainer",
    "UnknownStrategyError",
    "UnsupportedFeatureError",
    "__version__",
    "available_strategies",
]
