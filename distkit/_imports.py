"""Lazy, cached imports of optional backend libraries."""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import ModuleType

from distkit.errors import MissingDependencyError


@cache
def is_importable(module: str) -> bool:
    """Whether ``module`` can be found, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing or broken
        return False


def require(module: str, *, feature: str, hint: str) -> ModuleType:
    """Import ``module`` or raise a :class:`MissingDependencyError` that says how to get it.

    Args:
        module: dotted module name, e.g. ``"horovod.torch"``.
        feature: what needs it, e.g. ``"strategy='horovod'"``.
        hint: the fix, e.g. the command that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{feature} needs the Python module {module!r}, which could not be imported "
            f"({type(exc).__name__}: {exc}). {hint}"
        ) from exc
