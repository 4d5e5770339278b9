"""Argument checks any layer may use: each error names what was given, what is allowed."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
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


def unwritable_reason(folder: Path) -> str | None:
    """Why this process cannot create ``folder`` (where missing) and files in it; None if it can.

    Looks at the nearest part of ``folder`` that exists and creates an unnamed file there, gone
    at once (nothing is left behind), so a folder that is read-only, another user's or on a
    pseudo file system (``/proc``) is found even for root, whom ``os.access`` lets through. A
    part that is a file, or that cannot be looked at, is left to the caller's other checks and
    to the first write.
    """
    for part in (folder, *folder.parents):
        try:
            mode = part.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet: made by the first write, if its parent allows
        except OSError:
            return None
        if not stat.S_ISDIR(mode):
            return None
        try:
            with tempfile.TemporaryFile(dir=part):
                pass
        except OSError as exc:
            where = "" if part == folder else f" (the nearest existing folder of {str(folder)!r})"
            return f"{str(part)!r}{where} cannot be written: {exc.strerror or exc}"
        return None
    return None
