"""The trainer's callbacks, checked once and called in order on every rank."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from distkit._validate import check_instance
from distkit.callbacks._base import Callback
from distkit.callbacks._state import check_state
from distkit.errors import ConfigurationError


class CallbackList:
    """``Trainer(callbacks=...)`` validated: instances of :class:`Callback`, unique state keys."""

    def __init__(self, callbacks: Iterable[Callback] | None) -> None:
        if callbacks is None:
            callbacks = []
        if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
            raise ConfigurationError(
                f"callbacks must be a list of distkit.Callback instances, got "
                f"{type(callbacks).__name__}; wrap one in a list: callbacks=[...]"
            )
        self.callbacks = list(callbacks)
        for i, callback in enumerate(self.callbacks):
            check_instance(
                callback,
                Callback,
                where=f"callbacks[{i}]",
                name="distkit.Callback",
                fix="subclass distkit.Callback and override the hooks you need",
            )
        self.keys = _unique_keys(self.callbacks)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    @property
    def stop_each_step(self) -> bool:
        """Whether some callback may set ``should_stop`` in ``on_train_step_end``."""
        return any(
            type(c).on_train_step_end is not Callback.on_train_step_end and c.stops_training
            for c in self.callbacks
        )

    def overriding(self, hook: str) -> list[Callback]:
        """The callbacks whose class overrides ``hook`` (the base's does nothing)."""
        default = getattr(Callback, hook)
        return [c for c in self.callbacks if getattr(type(c), hook) is not default]

    def describe(self) -> str:
        """What every rank must agree on: the callbacks' kinds, in order, and whether one may
        stop after each step (then every step ends in a stop check, a collective: ranks that
        differ would pair it with another collective)."""
        each_step = "; stop check after each step" if self.stop_each_step else ""
        return (", ".join(self.keys) or "none") + each_step

    def call(self, hook: str, *args: Any) -> None:
        """``callback.<hook>(*args)`` for each callback, in order.

        An error keeps its own type; a note names the callback and hook it came from.
        """
        for callback, key in zip(self.callbacks, self.keys, strict=True):
            try:
                getattr(callback, hook)(*args)
            except Exception as exc:
                exc.add_note(f"(raised in callback {key}.{hook})")
                raise

    def call_on_exception(self, trainer: Any, exc: BaseException) -> None:
        """Every callback's ``on_exception``; their own errors are printed, not raised."""
        for callback, key in zip(self.callbacks, self.keys, strict=True):
            try:
                callback.on_exception(trainer, exc)
            except Exception as error:  # never replace the error fit is raising
                print(
                    f"distkit: callback {key}.on_exception raised {type(error).__name__}: "
                    f"{error} (while fit was failing with {type(exc).__name__})",
                    file=sys.stderr,
                )

    def validate(self, trainer: Any) -> None:
        """The built-ins' checks of the trainer, before training starts."""
        for callback in self.callbacks:
            check = getattr(callback, "_validate_trainer", None)
            if check is not None:
                check(trainer)

    def state_dict(self) -> dict[str, Any]:
        """Every callback's state by key, checked to load weights-only."""
        states = {}
        for callback, key in zip(self.callbacks, self.keys, strict=True):
            state = callback.state_dict()
            if not isinstance(state, Mapping):
                raise ConfigurationError(
                    f"callback {key}.state_dict() returned a {type(state).__name__}; return a "
                    "dict (of tensors, numbers, strings, lists and dicts)"
                )
            states[key] = dict(state)
            check_state(states[key], f"callback {key}.state_dict()")
        return states

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        """Each callback's saved state (callbacks the checkpoint does not know keep theirs).
        A saved state that no callback of this fit takes (an EMA's averages, resumed without
        the EMA callback) is said once, as a warning: it is dropped from the run."""
        for callback, key in zip(self.callbacks, self.keys, strict=True):
            if key in states:
                callback.load_state_dict(states[key])
        left = [key for key, state in states.items() if key not in self.keys and state]
        if left:
            warnings.warn(
                f"the checkpoint holds the state of callbacks this fit does not have: "
                f"{', '.join(left)} (their state is not carried on: a resumed EMA without "
                "its callback starts no averages, and the next checkpoint drops them). Pass "
                "the same callbacks to the Trainer to keep it",
                UserWarning,
                stacklevel=3,
            )


def _unique_keys(callbacks: list[Callback]) -> list[str]:
    keys: list[str] = []
    for callback in callbacks:
        key = str(callback.state_key)
        if key in keys:  # two of a kind: number them in order, as saved and loaded
            key = f"{key}#{sum(1 for k in keys if k.split('#')[0] == key)}"
        keys.append(key)
    return keys
