"""Strategy classes from other distributions: the ``distkit.strategies`` entry points.

A distribution declares ``[project.entry-points."distkit.strategies"] NAME = "module:Class"``;
the entry point's name is the strategy's name. Reading the entry points imports nothing; a
plugin's module is imported when its strategy is first asked for. Whatever is wrong with a
plugin becomes one :class:`PluginProblem` line that names its distribution.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from typing_extensions import override

if TYPE_CHECKING:
    from distkit.strategies.base import Strategy

ENTRY_POINT_GROUP = "distkit.strategies"
_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass(frozen=True)
class Plugin:
    """One ``distkit.strategies`` entry point.

    Attributes:
        name: the entry point's name, which is the strategy's name.
        target: ``"module:Class"``.
        distribution: the name of the distribution that declares it.
        version: that distribution's version.
    """

    name: str
    target: str
    distribution: str
    version: str

    @property
    def origin(self) -> str:
        """``"plugin <distribution> <version>"``."""
        return f"plugin {self.distribution} {self.version}"


@dataclass(frozen=True)
class PluginProblem:
    """Why a plugin's strategy is left out, and the fix; ``str()`` is one line."""

    plugin: Plugin
    reason: str
    fix: str = "Fix it"

    @override
    def __str__(self) -> str:
        p = self.plugin
        return (
            f"strategy plugin {p.name!r} from {p.distribution} {p.version} ({p.name} = "
            f"{p.target}) is left out: {self.reason}. {self.fix}, or uninstall it: pip "
            f"uninstall {p.distribution}"
        )


def discover(group: str = ENTRY_POINT_GROUP) -> tuple[list[Plugin], list[str]]:
    """The entry points of ``group`` (nothing imported), and a line per unreadable one."""
    import importlib.metadata as metadata

    try:
        entry_points = list(metadata.entry_points(group=group))
    except Exception as exc:  # broken metadata of some distribution must not break distkit
        return [], [f"reading the {group!r} entry points failed: {type(exc).__name__}: {exc}"]
    plugins = []
    for ep in entry_points:
        dist = getattr(ep, "dist", None)
        name = dist.name if dist is not None else "an unknown distribution"
        version = dist.version if dist is not None else "?"
        plugins.append(Plugin(ep.name, ep.value, name, version))
    return plugins, []


def check_name(name: str) -> str | None:
    """Why ``name`` cannot be a strategy name, or None."""
    if name == "auto":
        return "'auto' is not a strategy but the choice by launcher"
    if not _NAME.match(name):
        return (
            f"{name!r} is not a valid strategy name (lowercase letter first, then lowercase "
            "letters, digits, '-' or '_')"
        )
    return None


def load(target: str) -> object:
    """The object ``"module:Attr"`` names (``Attr`` may be dotted); import errors propagate."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{target!r} is not 'module:Class'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_class(obj: object, name: str) -> str | None:
    """Why ``obj`` cannot be the strategy registered as ``name``, or None."""
    from distkit.strategies.base import Strategy

    if not (isinstance(obj, type) and issubclass(obj, Strategy)):
        kind = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
        return f"it is not a distkit.Strategy subclass (it is {kind})"
    if obj.name != name:
        return (
            f"{obj.__qualname__}.name is {obj.name!r}, not {name!r}: set name = {name!r} on the "
            "class (the name it is registered under)"
        )
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        return f"{obj.__qualname__} is abstract: it does not implement {missing}"
    return None


def load_class(target: str, name: str) -> type[Strategy] | str:
    """The strategy class at ``target``, or why it cannot be had (one phrase).

    Whatever the import raises is caught but Ctrl-C: a plugin that parses the command line
    when imported ends in ``SystemExit`` (argparse's exit 2), which must not end the process
    that merely asked for a strategy (``distkit doctor``, ``distkit run``, a training script).
    What the import prints is held back and passed on unless it exited, since a plugin's
    argparse prints its usage text under the name of the program that imported it.
    """
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            obj = load(target)
    except KeyboardInterrupt:
        _replay(out, err)
        raise
    except SystemExit as exc:
        return _exited(exc, err.getvalue() + out.getvalue())
    except BaseException as exc:  # a plugin's import may fail in any way
        _replay(out, err)
        return f"importing it failed: {type(exc).__name__}: {exc}"
    _replay(out, err)
    reason = check_class(obj, name)
    if reason is not None:
        return reason
    assert isinstance(obj, type)
    return obj


def _replay(out: io.StringIO, err: io.StringIO) -> None:
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())


def _exited(exc: SystemExit, printed: str) -> str:
    said = [line.strip() for line in printed.splitlines() if line.strip()]
    last = f" after printing {said[-1][:200]!r}" if said else ""
    return (
        f"importing it called sys.exit({exc.code!r}){last}: the module parses the command "
        "line or exits when it is imported. A plugin module must only define its classes: "
        'parse arguments in a function or under `if __name__ == "__main__":`'
    )
