"""The Logger base class, and the argument checks the built-in loggers share."""

from __future__ import annotations

import abc
import contextlib
import numbers
import operator
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, SupportsIndex

import torch

from distkit.errors import ConfigurationError


class Logger(abc.ABC):
    """Receives hyperparameters and metrics from the trainer.

    The trainer calls these methods on rank 0 only, so a logger may be created on every rank;
    creating one must not touch files or the network (do that on first use). Only
    ``log_metrics`` must be written; the other methods default to doing nothing.
    """

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:  # noqa: B027
        """Record the run's settings, once, before the first step.

        Args:
            params: names and values (plain Python values: numbers, strings, ...).
        """

    @abc.abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record one set of values, e.g. ``{"train_loss": 0.41, "lr": 0.1}``.

        Args:
            metrics: names and plain Python numbers (the trainer converts tensors).
            step: the 1-based global optimizer step the values belong to.
        """

    def finalize(self, status: str) -> None:  # noqa: B027
        """Flush and close; called once when ``fit`` ends, and safe to call again.

        Args:
            status: how the run ended: ``"success"``, ``"failed"`` or ``"interrupted"``.
        """


def check_save_dir(logger: str, save_dir: object) -> Path:
    """``save_dir`` as a Path; a str or os.PathLike (an int or None is a mistake)."""
    if isinstance(save_dir, (str, os.PathLike)):
        path = os.fspath(save_dir)
        if isinstance(path, str) and path:
            return Path(path)
    raise ConfigurationError(
        f"{logger}(save_dir=...) must be a folder path (a non-empty str or os.PathLike), "
        f"got {type(save_dir).__name__}: {save_dir!r}"
    )


def check_step(step: object) -> int:
    """The step as an int >= 0 (numpy integers too); a float or bool is a mistake."""
    value = -1
    if not isinstance(step, bool) and isinstance(step, SupportsIndex):
        with contextlib.suppress(TypeError):  # a float tensor has __index__, and raises
            value = operator.index(step)
    if value < 0:
        raise ConfigurationError(
            f"step must be a non-negative integer (the global optimizer step), got "
            f"{type(step).__name__}: {step!r}"
        )
    return value


def as_number(key: object, value: object) -> int | float:
    """A metric value as a plain int or float.

    Integers (bools and numpy ints too) become ints, so ``epoch`` reads ``3``, not ``3.0``;
    floats, numpy floats and 0-dim tensors become floats. Anything else raises a
    ConfigurationError naming the key.
    """
    if not isinstance(key, str):
        raise ConfigurationError(
            f"metric names must be str, got {type(key).__name__}: {key!r} (value {value!r:.60})"
        )
    if isinstance(value, numbers.Integral):  # bool, IntEnum, numpy ints: plain 0 / 1 / 3
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return float(value)
    if isinstance(value, numbers.Real):  # numpy's number types register as Real
        return float(value)
    if isinstance(value, torch.Tensor):
        what = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    else:
        what = f"a {type(value).__name__}"
    raise ConfigurationError(
        f"metric {key!r} is {what} ({value!r:.60}); a logged "
        "value must be a real number: a bool, int, float or 0-dim tensor (use .item() or "
        ".mean() on a larger tensor)"
    )


def as_numbers(metrics: object) -> dict[str, int | float]:
    """Every value of ``metrics`` checked and converted (so a bad value writes nothing)."""
    if not isinstance(metrics, Mapping):
        raise ConfigurationError(
            f"metrics must be a mapping of names to numbers, got {type(metrics).__name__}"
        )
    return {key: as_number(key, value) for key, value in metrics.items()}
