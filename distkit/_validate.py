"""Argument checks any layer may use: each error names what was given, what is allowed."""

from __future__ import annotations

import os
from typing import Any

from distkit.errors import ConfigurationError


def check_ints(**values: tuple[Any, int]) -> None:
    for name, (value, low) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"{name} must be an integer >= {low}, got {value!r}")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigurationError(f"{name}={value!r}; allowed: {', '.join(allowed)}")


def check_seconds(name: str, value: object, *, allow_none: bool = True) -> None:
    """A duration in seconds: a positive int/float (or None where that switches it off)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        allowed = "a positive number of seconds" + (" or None (off)" if allow_none else "")
        raise ConfigurationError(f"{name} must be {allowed}, got {value!r}")


def check_flags(**values: object) -> None:
    for name, value in values.items():
        if not isinstance(value, bool):
            raise ConfigurationError(f"{name} must be True or False, got {value!r}")


def check_path(name: str, value: object, allowed: str) -> None:
    """An optional path: a str or os.PathLike (an int or True is a mistake, not a file name)."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"{name} must be {allowed}, got {value!r}")


def check_positive(name: str, value: object) -> None:
    """An optional positive finite number (a clipping threshold)."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < float(value) < float("inf")
    ):
        raise ConfigurationError(f"{name} must be a positive number or None (off), got {value!r}")


def check_instance(
    value: object, base: type, *, where: str, name: str, fix: str, args: str = "(...)"
) -> None:
    """``value`` is an instance of ``base``; a class instead, or another object, says the fix.

    Args:
        where: what ``value`` is, e.g. ``"callbacks[0]"``.
        name: ``base``'s public name, e.g. ``"distkit.Callback"``.
        fix: what to pass instead, e.g. ``"subclass distkit.Callback"``.
        args: how the hint calls the class (``"(...)"``, or ``"()"`` where none are needed).
    """
    if isinstance(value, type) and issubclass(value, base):
        raise ConfigurationError(
            f"{where} is the class {value.__name__}; pass an instance: {value.__name__}{args}"
        )
    if not isinstance(value, base):
        raise ConfigurationError(f"{where} is a {type(value).__name__}, not a {name}; {fix}")
