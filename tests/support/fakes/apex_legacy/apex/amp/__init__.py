"""FAKE ``apex.amp`` (legacy apex <= 25.04) for distkit's tests; no NVIDIA code, CPU only.

Public names as in real apex: ``initialize``, ``scale_loss``, ``state_dict``,
``load_state_dict``, ``master_params``, ``disable_casts``, the ``*_function`` decorators
and ``register_*_function`` (no-ops here: the fake never casts), and ``_amp_state``, the global
state *object*: after ``initialize``, ``apex.amp._amp_state.loss_scalers[i].loss_scale()`` is
the current scale of loss ``i`` and ``._has_overflow`` / ``._unskipped`` its last verdict and
streak. See ``frontend.py``, ``handle.py`` and ``scaler.py`` for the mirrored behaviour.
"""

from collections.abc import Callable
from typing import Any

from ._amp_state import _amp_state, master_params
from .frontend import initialize, load_state_dict, state_dict
from .handle import disable_casts, scale_loss


def half_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Real apex runs ``fn`` in fp16 under O1; the fake returns it unchanged."""
    return fn


def float_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Real apex runs ``fn`` in fp32 under O1; the fake returns it unchanged."""
    return fn


def promote_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Real apex promotes ``fn``'s inputs to the widest type under O1; unchanged here."""
    return fn


def register_half_function(module: Any, name: str) -> None:
    """No-op in the fake (real apex registers a cast applied by the next O1 initialize)."""


def register_float_function(module: Any, name: str) -> None:
    """No-op in the fake."""


def register_promote_function(module: Any, name: str) -> None:
    """No-op in the fake."""


__all__ = [
    "_amp_state",
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
