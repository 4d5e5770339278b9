"""Which strategies a message names: the registry's answers, handed down as a value.

Strategies and launchers name other strategies in their messages ("use strategy='ddp' (under
torchrun)", "strategies that keep a model you placed: ddp or horovod"). Those answers are the
registry's (its ``"auto"`` rules, its plugins), and the registry sits above the strategies and
the launchers, so it passes them down: ``make_strategy`` gives every strategy it hands out
``strategy.choices``, ``distkit run`` puts them in its :class:`~distkit.launch.LaunchRequest`,
``distkit doctor`` in its :class:`~distkit.launch.diagnosis.MachineFacts`. Nothing is
installed at import.

The registry answers lazily (naming the strategies that keep a placed model loads every
strategy class, plugins included, so it is asked only when a message needs it). A strategy
built and set up by hand, without the registry, names the built-in table's answers
(:data:`BUILTIN_CHOICES`); ``tests/registry/test_choices.py`` holds the two alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from distkit.launch._env import LaunchEnv


class StrategyChoices(Protocol):
    """What the messages below the registry ask of it."""

    def auto_name(self, env: LaunchEnv) -> str:
        """The strategy ``"auto"`` picks for a process launched as ``env`` says."""
        ...

    def keeping_placed_models(self) -> list[str]:
        """The strategies that train a model the user placed on devices where it is."""
        ...

    def multi_process(self) -> list[str]:
        """The strategies ``"auto"`` picks under a multi-process launcher."""
        ...


@dataclass(frozen=True)
class FixedChoices:
    """Answers read from a table (the built-in strategies', without plugins)."""

    #: launcher -> the strategy ``"auto"`` picks there (a launcher not listed: ``fallback``)
    auto: Mapping[str, str] = field(default_factory=dict)
    fallback: str = "ddp"
    keeping: tuple[str, ...] = ()
    multi: tuple[str, ...] = ()

    def auto_name(self, env: LaunchEnv) -> str:
        return self.auto.get(env.launcher, self.fallback)

    def keeping_placed_models(self) -> list[str]:
        return list(self.keeping)

    def multi_process(self) -> list[str]:
        return list(self.multi)


#: the built-in registry's answers with no plugin and no Horovod built with MPI (under mpirun
#: the registry then picks ddp too)
BUILTIN_CHOICES = FixedChoices(
    auto={"horovodrun": "horovod", "none": "dp"},
    fallback="ddp",
    keeping=("ddp", "horovod"),
    multi=("ddp", "horovod"),
)


def native_alternative(choices: StrategyChoices) -> str:
    """The strategy ``"auto"`` picks under torchrun: what to suggest where a backend can't run."""
    from distkit.launch._env import LaunchEnv

    return choices.auto_name(LaunchEnv(launcher="torchrun"))
