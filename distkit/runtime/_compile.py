"""``Trainer(compile=...)``: which compiler to apply, and to which module.

The strategy decides *what* to compile (its ``compile_model`` hook: the DDP wrapper, the
sharded module...); this module decides *how*: ``torch.compile`` with the user's arguments,
or, for a model the user compiled themselves, their own compile settings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distkit.errors import ConfigurationError

#: compiles a module: ``torch.compile`` with fixed arguments, or a model's own dynamo context
Compiler = Callable[[nn.Module], nn.Module]


def check_compile(value: object) -> dict[str, Any] | None:
    """``compile=``: False (off), True (torch.compile's defaults) or a dict of its arguments.

    Returns the arguments, or None when off.
    """
    if value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return dict(value)
    raise ConfigurationError(
        f"compile must be True, False or a dict of torch.compile arguments (e.g. "
        f"{{'mode': 'max-autotune'}}), got {value!r}"
    )


def describe(options: dict[str, Any] | None) -> str:
    """The compile settings as every rank can compare them (a function by its name, not its
    address, which differs between processes)."""
    if options is None:
        return "off"
    return "{" + ", ".join(f"{key}={_stable(value)}" for key, value in options.items()) + "}"


def _stable(value: object) -> str:
    if value is None or isinstance(value, (str, int, float, bool)):
        return repr(value)
    if isinstance(value, dict):
        return describe(value)
    kind = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')}"


def plan(model: nn.Module, options: dict[str, Any] | None) -> tuple[nn.Module, Compiler | None]:
    """(the module to train, how to compile it; None: not at all).

    A model the user passed through ``torch.compile``: distkit trains its original module
    (so checkpoints hold its own names, without ``_orig_mod.``) and compiles it again in the
    order the backend needs: with ``options`` when given, else with the user's own settings
    (backend, mode...), reapplied through the compiled model's dynamo context.
    """
    original = getattr(model, "_orig_mod", None)
    if isinstance(model, nn.Module) and isinstance(original, nn.Module):
        own = getattr(model, "dynamo_ctx", None)
        if options is None and callable(own):
            return original, own
        return original, _torch_compile(options or {})
    if options is None:
        return model, None
    return model, _torch_compile(options)


def _torch_compile(options: dict[str, Any]) -> Compiler:
    return functools.partial(torch.compile, **options)  # type: ignore[return-value]
