"""Plugins and callers written against distkit 0.1's Strategy hooks.

The Strategy was narrowed (state I/O and elastic training became capability objects, the two
start hooks one, the scaler's state the precision's). This module says what replaced each
removed hook (for the messages), forwards a removed name called on a strategy to what does
its work now, and adapts a plugin that still overrides the state hooks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit.faults import _channel
from distkit.strategies.capabilities import StateIO

#: a Strategy (annotated loosely: this module sits below the interface it adapts)
Strategy = Any


#: the hooks that became :class:`~distkit.strategies.capabilities.StateIO`'s methods
STATE_IO_HOOKS = (
    "model_state_dict",
    "optimizer_state_dict",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "checkpoint_state",
)
#: hooks removed from Strategy, and what replaced each (for the messages)
REPLACED = {
    **{name: f"strategy.state_io.{name}" for name in STATE_IO_HOOKS},
    "connect": "strategy.start(options)",
    "setup_environment": "strategy.start()",
    "announce_failure": "distkit.faults._channel.announce_failure(strategy.side_channel(), m)",
    "peer_failure": "distkit.faults._channel.peer_failure(strategy.side_channel())",
    "run_training": "strategy.elastic (None, or an Elastic whose run(body, snapshot) runs it)",
    "commit": "strategy.elastic.commit()",
    "state_dict": "strategy.precision.state_dict() (the loss scaler, GradScaler form)",
    "load_state_dict": "strategy.precision.load_state_dict(scaler_state)",
}


def _run_training(strategy: Strategy, body: Callable[[], None], snapshot: Any) -> None:
    elastic = strategy.elastic
    if elastic is None:
        body()
    else:
        elastic.run(body, snapshot)


def _commit(strategy: Strategy) -> None:
    elastic = strategy.elastic
    if elastic is not None:
        elastic.commit()


def _state_hook(name: str) -> Callable[..., Any]:
    return lambda strategy, *args, **kwargs: getattr(strategy.state_io, name)(*args, **kwargs)


#: what each removed name does now, for callers still using it (with a DeprecationWarning)
FORWARDS: dict[str, Callable[..., Any]] = {
    **{name: _state_hook(name) for name in STATE_IO_HOOKS},
    "connect": lambda strategy, options: strategy.start(options),
    "setup_environment": lambda strategy: strategy.start(),
    "announce_failure": lambda strategy, message: _channel.announce_failure(
        strategy.side_channel(), message
    ),
    "peer_failure": lambda strategy: _channel.peer_failure(strategy.side_channel()),
    "run_training": _run_training,
    "commit": _commit,
    "state_dict": lambda strategy: {"scaler": strategy.precision.state_dict()},
    "load_state_dict": lambda strategy, state: strategy.precision.load_state_dict(
        state.get("scaler") or {}
    ),
}


def overrides(cls: type, name: str) -> bool:
    return any(name in vars(klass) for klass in cls.__mro__ if klass is not object)


class LegacyStateIO(StateIO):
    """State I/O for a plugin that overrides the per-strategy state hooks of distkit 0.1
    (``model_state_dict`` & co.): its own methods where it has them, the defaults elsewhere."""

    @override
    def model_state_dict(
        self, model: nn.Module, *, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        own = _own(self.strategy, "model_state_dict")
        if own is None:
            return super().model_state_dict(model, rank0_only=rank0_only)
        return own(model, rank0_only=rank0_only)

    @override
    def weight_entries(self, model: nn.Module) -> dict[str, Any]:
        # the plugin's own full state (gathered whole: its sharding is unknown here); tied
        # weights are then told apart by the names of the module's own state
        if _own(self.strategy, "model_state_dict") is None:
            return super().weight_entries(model)
        full = self.model_state_dict(model)
        own = model.state_dict(keep_vars=True)
        firsts: dict[int, str] = {}
        return {name: full[firsts.setdefault(id(own.get(name, name)), name)] for name in full}

    @override
    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        own = _own(self.strategy, "optimizer_state_dict")
        if own is None:
            return super().optimizer_state_dict(optimizer, rank0_only=rank0_only)
        return own(optimizer, rank0_only=rank0_only)

    @override
    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        own = _own(self.strategy, "load_model_state_dict")
        if own is None:
            super().load_model_state_dict(model, state)
        else:
            own(model, state)

    @override
    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        own = _own(self.strategy, "load_optimizer_state_dict")
        if own is None:
            super().load_optimizer_state_dict(optimizer, state)
        else:
            own(optimizer, state)

    @override
    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path | str
    ) -> dict[str, Any]:
        own = _own(self.strategy, "checkpoint_state")
        if own is None:
            return super().checkpoint_state(model, optimizer, path)
        return own(model, optimizer, path)


def _own(strategy: object, name: str) -> Callable[..., Any] | None:
    """``strategy``'s own method ``name`` (a subclass's), or None where it has none."""
    if not overrides(type(strategy), name):
        return None
    return getattr(strategy, name)


def takes_before_step(strategy: object) -> bool:
    """Whether ``strategy.step`` takes ``before_step`` (a plugin's own ``step`` written before
    the keyword existed does not: it gets every step without it)."""
    parameters = inspect.signature(strategy.step).parameters  # type: ignore[attr-defined]
    return "before_step" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
