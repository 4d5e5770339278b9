"""``Trainer(compile=...)``: which compiler to apply, and to which module.

The strategy decides *what* to compile (its ``compile_model`` hook: the DDP wrapper, the
sharded module...); this module decides *how*: ``torch.compile`` with the user's arguments,
each repeated block in place (``compile="blocks"``, see :mod:`._compile_blocks`), or, for a
model the user compiled themselves, their own compile settings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distkit.errors import ConfigurationError
from distkit.runtime._compile_blocks import BlockCompiler

#: compiles a module: ``torch.compile`` with fixed arguments, or a model's own dynamo context
Compiler = Callable[[nn.Module], nn.Module]


#: ``compile=``'s own key beside torch.compile's arguments: compile each repeated block
BLOCKS = "blocks"


def check_compile(value: object) -> dict[str, Any] | None:
    """``compile=``: False (off), True (torch.compile's defaults), a dict of its arguments,
    or ``"blocks"`` (each repeated block compiled with torch.compile's defaults; in a dict,
    ``"blocks": True`` beside the arguments).

    Returns the arguments (``"blocks": True`` among them for a per-block compile), or None
    when off.
    """
    if value is False:
        return None
    if value is True:
        return {}
    if value == BLOCKS:
        return {BLOCKS: True}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if not isinstance(value.get(BLOCKS, False), bool):
            raise ConfigurationError(
                f"compile={{'blocks': {value[BLOCKS]!r}, ...}}: 'blocks' is True (compile "
                "each repeated block) or False (the whole model), got "
                f"{type(value[BLOCKS]).__name__}"
            )
        options = dict(value)
        if not options.get(BLOCKS, True):
            del options[BLOCKS]
        return options
    raise ConfigurationError(
        f"compile must be True, False or a dict of torch.compile arguments (e.g. "
        f"{{'mode': 'max-autotune'}}), or 'blocks' to compile each repeated block (a "
        f"transformer's layers; {{'blocks': True, 'mode': ...}} with arguments), got {value!r}"
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
        # (``options`` with "blocks": the user's whole-model compile gives way to blocks)
        if options is None and callable(own):
            return original, own
        return original, _torch_compile(options or {})
    if options is None:
        return model, None
    return model, _torch_compile(options)


def _torch_compile(options: dict[str, Any]) -> Compiler:
    if options.get(BLOCKS):
        arguments = {key: value for key, value in options.items() if key != BLOCKS}
        return BlockCompiler(arguments)
    return functools.partial(torch.compile, **options)  # type: ignore[return-value]
