"""The registry's answers for the modules below it: which strategy to suggest, which to run.

Strategies and launchers name other strategies in their messages ("use strategy='ddp' (under
torchrun)", "strategies that keep a model you placed: ddp or horovod"), and ``distkit run``
finds the class behind a name. Those answers are the registry's (its ``"auto"`` rules and its
plugins), and the registry sits above the strategies, so they cannot import it: the registry
installs its answers here when it is imported, which ``import distkit`` does before anything
else runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from distkit.launch._env import LaunchEnv
    from distkit.strategies.base import Strategy


class RegistryView(Protocol):
    """What the registry answers (``distkit.registry`` implements it)."""

    def auto_name(self, env: LaunchEnv) -> str:
        """The strategy ``"auto"`` picks for a process launched as ``env`` says."""
        ...

    def keeping_placed_models(self) -> list[str]:
        """The strategies that train a model the user placed on devices where it is."""
        ...

    def multi_process(self) -> list[str]:
        """The strategies ``"auto"`` picks under a multi-process launcher."""
        ...

    def strategy_class(self, name: str) -> type[Strategy]:
        """The class registered under ``name`` (raises UnknownStrategyError)."""
        ...


_view: RegistryView | None = None


def install(view: RegistryView) -> None:
    """Called once, by ``distkit.registry`` at import."""
    global _view
    _view = view


def registry() -> RegistryView:
    if _view is None:
        raise RuntimeError(
            "distkit.registry has not been imported: import distkit (or distkit.registry) "
            "before using a strategy"
        )
    return _view


def auto_strategy_name(env: LaunchEnv) -> str:
    """The strategy that ``"auto"`` picks for a process launched as ``env`` says."""
    return registry().auto_name(env)
