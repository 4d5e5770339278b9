"""distkit: one PyTorch training script, any data-parallel backend.

>>> import distkit
>>> trainer = distkit.Trainer(strategy="ddp", batch_size=32)  # doctest: +SKIP

Importing distkit imports no backend library (Horovod, apex) and changes nothing.
"""

import sys as _sys

from distkit import callbacks, loggers
from distkit._version import __version__
from distkit.callbacks import Callback
from distkit.checkpoint._load_weights import load_weights
from distkit.data.streams import ShardedStream
from distkit.errors import (
    ConfigurationError,
    DistkitError,
    LauncherMismatchError,
    MissingDependencyError,
    PeerFailureError,
    PeerStuckError,
    StrategyPluginError,
    UnknownStrategyError,
    UnsupportedFeatureError,
    WorkerError,
)
from distkit.launch import diagnosis as _diagnosis
from distkit.launch._spawn import spawn
from distkit.loss import Loss
from distkit.metrics import Accuracy, ConfusionMatrix, MeanIoU, Metric
from distkit.registry import BUILTIN_STRATEGIES as _BUILTINS
from distkit.registry import available_strategies, register_strategy
from distkit.runtime import Profiler, Runtime, RuntimeOptions, init_empty, read_predictions
from distkit.strategies.base import Strategy, Topology, TrainOptions
from distkit.strategies.syncbn import GlobalBatchNorm
from distkit.trainer import FitResult, Trainer

# MachineFacts and StrategyReport lived in distkit/diagnosis.py until the launch package took
# them in: a plugin's `from distkit.diagnosis import StrategyReport` still imports
_sys.modules.setdefault("distkit.diagnosis", _diagnosis)

# The built-in strategy classes (distkit.DDPStrategy, ...), named by the registry and imported
# on first use: importing distkit imports no strategy module
_STRATEGY_CLASSES = {target.rpartition(":")[2]: name for name, target in _BUILTINS.items()}


def __getattr__(name: str) -> object:
    if name in _STRATEGY_CLASSES:
        from distkit.registry import resolve_strategy_class

        return resolve_strategy_class(_STRATEGY_CLASSES[name])
    raise AttributeError(f"module 'distkit' has no attribute {name!r}")


__all__ = [
    "Accuracy",
    "Callback",
    "ConfigurationError",
    "ConfusionMatrix",
    "DistkitError",
    "FitResult",
    "GlobalBatchNorm",
    "LauncherMismatchError",
    "Loss",
    "MeanIoU",
    "Metric",
    "MissingDependencyError",
    "PeerFailureError",
    "PeerStuckError",
    "Profiler",
    "Runtime",
    "RuntimeOptions",
    "ShardedStream",
    "Strategy",
    "StrategyPluginError",
    "Topology",
    "TrainOptions",
    "Trainer",
    "UnknownStrategyError",
    "UnsupportedFeatureError",
    "WorkerError",
    "__version__",
    "available_strategies",
    "callbacks",
    "init_empty",
    "load_weights",
    "loggers",
    "read_predictions",
    "register_strategy",
    "spawn",
]
__all__ += _STRATEGY_CLASSES
__all__.sort()
