"""Activation checkpointing: chosen modules keep no activations for backward and run their
forward again when backward needs them (less memory, one more forward per step).

``Trainer(activation_checkpointing=[Block, ...])`` / ``Runtime(activation_checkpointing=...)``
takes module classes, or a predicate ``fn(module) -> bool``. Each matching module (the
outermost where matches nest) gets its ``forward`` run through torch's *non-reentrant*
``torch.utils.checkpoint.checkpoint``, before the strategy wraps the model: so before DDP's
wrapper, inside FSDP's units, under Horovod's and DeepSpeed's hooks. The module stays where
it is (no wrapper module): ``state_dict`` keys, attribute access and hooks are unchanged.

Non-reentrant, because reentrant checkpointing runs a second, inner backward that DDP sees as
a second gradient for the same parameters ("Expected to mark a variable ready only once"),
and it drops gradients for inputs that do not require them. The RNG state is restored for
the recomputation, so dropout draws the same masks: the weights equal those without
checkpointing.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distkit.errors import ConfigurationError

#: what ``activation_checkpointing=`` takes
ActivationCheckpointing = Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | None
Policy = Callable[[nn.Module], bool]

_MARK = "_distkit_checkpointed"


def checkpoint_policy(value: object) -> Policy | None:
    """``activation_checkpointing=`` as a predicate (None: off), or a clear refusal."""
    if value is None:
        return None
    if isinstance(value, type) and issubclass(value, nn.Module):
        classes: tuple[type[nn.Module], ...] = (value,)
    elif isinstance(value, (list, tuple, set, frozenset)):
        wrong = [v for v in value if not (isinstance(v, type) and issubclass(v, nn.Module))]
        if wrong:
            raise ConfigurationError(
                f"activation_checkpointing={value!r}: {wrong[0]!r} is not a torch.nn.Module "
                "subclass; allowed: module classes (activation_checkpointing=[Block]), or a "
                "function module -> bool, or None"
            )
        if not value:
            return None
        classes = tuple(value)
    elif callable(value):
        return value
    else:
        raise ConfigurationError(
            f"activation_checkpointing={value!r} ({type(value).__name__}); allowed: module "
            "classes (activation_checkpointing=[Block]), a function module -> bool, or None"
        )

    def is_chosen(module: nn.Module) -> bool:
        return isinstance(module, classes)

    is_chosen.__qualname__ = f"isinstance(module, {tuple(c.__name__ for c in classes)})"
    return is_chosen


def apply_checkpointing(model: nn.Module, policy: Policy) -> int:
    """Checkpoint every module ``policy`` chooses in ``model`` (the outermost where chosen
    modules nest); returns how many. A module already checkpointed is left as it is."""
    count = 0

    def visit(module: nn.Module) -> None:
        nonlocal count
        if getattr(module, _MARK, False):
            count += 1
            return
        if policy(module):
            _checkpoint_forward(module)
            count += 1
            return
        for child in module.children():
            visit(child)

    visit(model)
    if count == 0:
        warnings.warn(
            f"activation_checkpointing matched no module of {type(model).__name__} "
            f"({getattr(policy, '__qualname__', policy)}): it trains without checkpointing. "
            f"Its module classes: {sorted({type(m).__name__ for m in model.modules()})}",
            UserWarning,
            stacklevel=3,
        )
    return count


def _checkpoint_forward(module: nn.Module) -> None:
    # bound to the module (not a closure over its forward): a deepcopy of the model (a CPU
    # copy for predictions, say) then runs its own weights, not this module's
    module.forward = types.MethodType(forward, module)
    setattr(module, _MARK, True)


def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A checkpointed module's forward: its class's, through non-reentrant checkpointing.
    (Named ``forward``: a pickled model restores it as the plain forward, unchecked.)"""
    plain = type(self).forward
    if not torch.is_grad_enabled():  # evaluation: nothing is kept for backward anyway
        return plain(self, *args, **kwargs)
    return checkpoint(plain, self, *args, use_reentrant=False, **kwargs)
