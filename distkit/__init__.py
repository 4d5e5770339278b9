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
    PeerFailureError,
    UnknownStrategyError,
    UnsupportedFeatureError,
)
from distkit.metrics import Accuracy, ConfusionMatrix, MeanIoU, Metric
from distkit.registry import available_strategies
from distkit.strategies.base import Strategy, Topology, TrainOptions
from distkit.syncbn import GlobalBatchNorm
from distkit.trainer import FitResult, Trainer

__version__ = "0.1.0"

# Strategy classes, imported on first use (importing distkit imports no backend module)
_LAZY = {
    "ApexStrategy": "distkit.strategies.apex",
    "DDPStrategy": "distkit.strategies.ddp",
    "DataParallelStrategy": "distkit.strategies.dp",
    "HorovodStrategy": "distkit.strategies.horovod",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distkit' has no attribute {name!r}")


__all__ = [
    "Accuracy",
    "ApexStrategy",
    "ConfigurationError",
    "ConfusionMatrix",
    "DDPStrategy",
    "DataParallelStrategy",
    "DistkitError",
    "FitResult",
    "GlobalBatchNorm",
    "HorovodStrategy",
    "LauncherMismatchError",
    "MeanIoU",
    "Metric",
    "MissingDependencyError",
    "PeerFailureError",
    "Strategy",
    "Topology",
    "TrainOptions",
    "Trainer",
    "UnknownStrategyError",
    "UnsupportedFeatureError",
    "__version__",
    "available_strategies",
]
