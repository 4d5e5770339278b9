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

The recomputation must not count as a second forward: a BatchNorm (any norm layer with
running statistics) inside a checkpointed block would otherwise update its running mean,
variance and ``num_batches_tracked`` twice per step (the weights the same, the evaluation
outputs not). Each recomputation puts those buffers back as the forward left them. A module
of your own that changes other buffers in its forward is not known here: keep it out of the
checkpointed blocks.

The checkpointed forward is the set-up's: closing the Runtime (the Trainer) gives the user's
modules their own forward back.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
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


def apply_checkpointing(model: nn.Module, policy: Policy) -> list[nn.Module]:
    """Checkpoint every module ``policy`` chooses in ``model`` (the outermost where chosen
    modules nest); returns those it checkpointed now. A module already checkpointed is
    left as it is."""
    count = 0
    done: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        nonlocal count
        if getattr(module, _MARK, False):
            count += 1
            return
        if policy(module):
            _checkpoint_forward(module)
            done.append(module)
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
    return done


def remove_checkpointing(modules: list[nn.Module]) -> None:
    """Give ``modules`` (what :func:`apply_checkpointing` returned) their own forward back."""
    for module in modules:
        if getattr(module, _MARK, False):
            module.__dict__.pop("forward", None)
            delattr(module, _MARK)


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
    return checkpoint(_Once(plain), self, *args, use_reentrant=False, **kwargs)


class _Once:
    """A block's forward whose first call is the forward and every later call (backward's
    recomputation) leaves the running statistics of its norm layers as they were."""

    def __init__(self, plain: Callable[..., Any]) -> None:
        self.plain = plain
        self.ran = False

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:
            self.ran = True
            return self.plain(module, *args, **kwargs)
        kept = _running_statistics(module)
        try:  # torch may end a recomputation early, by raising inside it
            return self.plain(module, *args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)


def _running_statistics(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each training norm layer's running statistics in ``module``, with a copy of each."""
    kept = []
    for layer in module.modules():
        if isinstance(layer, _NormBase) and layer.training and layer.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                buffer = getattr(layer, name, None)
                if isinstance(buffer, torch.Tensor):
                    kept.append((buffer, buffer.detach().clone()))
    return kept
