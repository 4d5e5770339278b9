"""Strategy names -> classes, resolved lazily so that no backend is imported before it is chosen."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from typing import TYPE_CHECKING

from distkit._env import LaunchEnv
from distkit.errors import UnknownStrategyError

if TYPE_CHECKING:
    from distkit.strategies.base import Strategy

_STRATEGIES: dict[str, str] = {
    "apex": "distkit.strategies.apex:ApexStrategy",
    "ddp": "distkit.strategies.ddp:DDPStrategy",
    "dp": "distkit.strategies.dp:DataParallelStrategy",
    "horovod": "distkit.strategies.horovod:HorovodStrategy",
}


def available_strategies() -> list[str]:
    """The registered strategy names, sorted (``"auto"`` is accepted too, but is not one)."""
    return sorted(name for name, target in _STRATEGIES.items() if _module_exists(target))


def _module_exists(target: str) -> bool:
    module = target.split(":", 1)[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _own_process_group() -> bool:
    """A multi-process torch.distributed group the user made (mp.spawn + init_process_group)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def auto_strategy_name(env: LaunchEnv) -> str:
    """The strategy that fits how this process was launched.

    torchrun / ``torch.distributed.launch`` -> ``"ddp"``; horovodrun / mpirun -> ``"horovod"``;
    a single process -> ``"dp"`` (which on CPU or one GPU simply runs the module).
    """
    if env.is_torch_launcher or _own_process_group():
        return "ddp"
    if env.is_horovod_launcher:
        return "horovod"
    return "dp"


def resolve_strategy_class(name: str) -> type[Strategy]:
    """The class registered under ``name``.

    Raises:
        UnknownStrategyError: ``name`` is not registered; the message suggests the closest name.
    """
    if not isinstance(name, str):
        raise UnknownStrategyError(
            f"strategy must be a name or a distkit.Strategy instance, got {type(name).__name__} "
            f"{name!r}. Available: {', '.join(['auto', *available_strategies()])}"
        )
    key = name.strip().lower()
    target = _STRATEGIES.get(key)
    if target is None or not _module_exists(target):
        choices = available_strategies()
        close = difflib.get_close_matches(key, [*choices, "auto"], n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownStrategyError(
            f"unknown strategy {name!r}.{hint} Available: {', '.join(['auto', *choices])}"
        )
    module_name, class_name = target.split(":")
    cls: type[Strategy] = getattr(importlib.import_module(module_name), class_name)
    return cls


def make_strategy(strategy: str | Strategy) -> Strategy:
    """A strategy instance from a name (``"auto"`` follows the launcher) or an instance."""
    from distkit.strategies.base import Strategy

    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str) and strategy.strip().lower() == "auto":
        strategy = auto_strategy_name(LaunchEnv.detect())
    return resolve_strategy_class(strategy)()
