"""A callback's state as it goes into a checkpoint: values that load weights-only.

Checkpoints load with ``torch.load(weights_only=True)``, which rebuilds only plain types:
``np.float64`` (a subclass of ``float``), an ``IntEnum`` or a namedtuple pickles as its own
class and would make the whole checkpoint unloadable. So the check is on exact types, and
a value that is refused names its own fix; nothing is converted silently (a callback would
get back a different type than it saved).
"""

from __future__ import annotations

import enum
import reprlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from distkit.errors import ConfigurationError

_LEAVES = (bool, int, float, str, type(None))  # bool first: the fix names the closest type
_TENSORS = (torch.Tensor, nn.Parameter)
_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = (list, tuple, torch.Size)
_ALLOWED = "tensors, int, float, bool, str, None, lists, tuples and dicts"


def check_state(value: Any, where: str) -> None:
    """Raise unless ``value`` (a callback's state, found at ``where``) loads weights-only.

    Raises:
        ConfigurationError: naming the entry (``where`` plus its key path), the value, and
            the conversion that makes it plain.
    """
    kind = type(value)
    if kind in _MAPPINGS:
        for key, item in value.items():
            check_state(key, f"a key of {where}")
            check_state(item, f"{where}[{key!r}]")
    elif kind in _SEQUENCES:
        for i, item in enumerate(value):
            check_state(item, f"{where}[{i}]")
    elif kind not in _LEAVES and kind not in _TENSORS:
        raise ConfigurationError(
            f"{where} holds {reprlib.repr(value)}, a {kind.__module__}.{kind.__qualname__}, "
            f"which a checkpoint cannot load weights-only: store {_fix(value)} instead. A "
            f"callback's state may hold {_ALLOWED} only"
        )


def _fix(value: Any) -> str:
    """The plain value to store in place of ``value``."""
    if isinstance(value, np.ndarray):
        return "value.tolist() (or torch.from_numpy(value))"
    if isinstance(value, np.generic):
        plain = type(value.item())
        if plain in _LEAVES:
            return f"{plain.__name__}(value)"
        return f"a plain value made from it (value.item() is a {plain.__name__})"
    if isinstance(value, enum.Enum):
        return "value.value"
    if isinstance(value, torch.Tensor):
        return "value.as_subclass(torch.Tensor)"
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return "value._asdict() (or tuple(value))"
    if isinstance(value, Mapping):
        return "dict(value)"
    for plain in (*_LEAVES, list, tuple):
        if isinstance(value, plain):
            return f"{plain.__name__}(value)"
    if isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray)):
        return "list(value)"
    return "its plain values (e.g. obj.state_dict(), or the numbers it holds)"
