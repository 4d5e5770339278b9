"""The Logger base class, and the argument checks the built-in loggers share."""

from __future__ import annotations

import abc
import contextlib
import numbers
import operator
import os
import stat
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

    Loggers are best-effort: when one raises during ``fit``, the trainer warns (once per kind
    of error, naming the logger and the error), goes on training, calls it again at the next
    log point, and stops calling it after 10 failures in a row (it still gets ``finalize``).
    A ``strict`` logger's errors end the fit instead, as any error in the training loop does;
    while a fit is already failing, no logger's error replaces the fit's own.

    Args:
        strict: True: an exception from this logger ends the fit; False: it is reported and
            training goes on; None (default): the class attribute ``strict`` decides (False
            unless a subclass sets ``strict = True``). A subclass that does not call
            ``super().__init__()`` gets the class attribute too; ``logger.strict = True``
            changes one instance.
    """

    strict: bool = False

    def __init__(self, *, strict: bool | None = None) -> None:
        if strict is not None:  # None keeps the class attribute, which a subclass may set
            self.strict = check_strict(type(self).__name__, strict)

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


def check_strict(logger: str, strict: object) -> bool:
    """``strict`` as a bool; anything else (1, "yes") is a mistake, not a truth value."""
    if not isinstance(strict, bool):
        raise ConfigurationError(
            f"{logger}(strict=...) must be True or False, got {type(strict).__name__}: "
            f"{strict!r}; pass strict=True to end the fit on this logger's errors, or False (or "
            "leave it out) to have them reported while training goes on"
        )
    return strict


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


def check_mapping(
    call: str, argument: str, value: object, *, meaning: str, str_values: bool = False
) -> dict[str, Any]:
    """``value`` as a dict with str keys (and str values, when ``str_values``); None gives {}.
    Anything else is a ConfigurationError saying ``meaning`` (what it must be)."""
    if value is None:
        return {}
    if isinstance(value, Mapping) and all(
        isinstance(key, str) and (not str_values or isinstance(item, str))
        for key, item in value.items()
    ):
        return dict(value)
    raise ConfigurationError(
        f"{call}({argument}=...) must be {meaning} or None, got {type(value).__name__}: "
        f"{value!r:.80}"
    )


def check_text(call: str, argument: str, value: object, *, optional: bool = False) -> str | None:
    """``value`` as a non-empty str (or None, when ``optional``), else a ConfigurationError."""
    if value is None and optional:
        return None
    if isinstance(value, str) and value.strip():
        return value
    allowed = "a non-empty str" + (" or None" if optional else "")
    raise ConfigurationError(
        f"{call}({argument}=...) must be {allowed}, got {type(value).__name__}: {value!r}"
    )


def check_no_file_in_the_way(call: str, folder: Path, arguments: str) -> None:
    """Refuse a ``folder`` that can never be created because a part of it is a file.

    Only looks (``stat`` on the folder and its existing parents): creating a logger creates
    nothing. A part that cannot be looked at (no permission) is left to the first write.

    Args:
        call: the constructor call as the user wrote it, e.g. ``CSVLogger(save_dir='x')``.
        folder: the folder the logger will write into.
        arguments: the arguments that choose the folder, for the fix (``save_dir``).
    """
    for part in (folder, *folder.parents):
        try:
            mode = part.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet: the first write creates it
        except OSError:
            return
        if stat.S_ISDIR(mode):
            return
        below = "" if part == folder else f" (the folder {str(folder)!r} can never be created)"
        raise ConfigurationError(
            f"{call}: {str(part)!r} is a file, not a folder; pass a {arguments} whose existing "
            f"parts are folders, or move the file away{below}"
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
