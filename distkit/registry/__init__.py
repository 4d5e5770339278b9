"""Strategy names -> classes: the built-ins, :func:`register_strategy`, and plugins.

This is the one table of backend names. Everything else (``"auto"``, ``distkit run``,
``distkit doctor``, the lazy ``distkit.DDPStrategy`` exports) asks the registered classes.
Built-ins are ``"module:Class"`` strings imported when first used; plugins come from the
``distkit.strategies`` entry points, read when a name is not a built-in (see
:mod:`distkit.registry._plugins`). A broken plugin is left out with one line naming its
distribution; it never breaks the other strategies.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from distkit.errors import ConfigurationError, StrategyPluginError, UnknownStrategyError
from distkit.launch._env import LaunchEnv
from distkit.registry import _plugins

if TYPE_CHECKING:
    from distkit.strategies.base import Strategy

#: distkit's own strategies. ``"auto"`` tries them in this order.
BUILTIN_STRATEGIES: Mapping[str, str] = MappingProxyType(
    {
        "ddp": "distkit.strategies.ddp:DDPStrategy",
        "dp": "distkit.strategies.dp:DataParallelStrategy",
        "horovod": "distkit.strategies.horovod:HorovodStrategy",
        "apex": "distkit.strategies.apex:ApexStrategy",
        "fsdp": "distkit.strategies.fsdp:FSDPStrategy",
        "deepspeed": "distkit.strategies.deepspeed:DeepSpeedStrategy",
    }
)


class StrategyRegistry:
    """Strategy names and the classes behind them.

    Names resolve in this order: the built-ins, names added with :meth:`register`, then the
    ``distkit.strategies`` entry points (read once, on first need). A plugin whose name is
    a built-in's is left out, and :meth:`problems` says so; a name that two plugins claim is
    neither's: asking for it raises, naming both (and :meth:`problems` lists it).

    Args:
        builtins: name -> ``"module:Class"`` of the strategies that cannot be replaced.
        entry_point_group: the entry point group to read plugins from; None reads none.
    """

    def __init__(
        self,
        builtins: Mapping[str, str] = BUILTIN_STRATEGIES,
        *,
        entry_point_group: str | None = _plugins.ENTRY_POINT_GROUP,
    ) -> None:
        self._builtins = dict(builtins)
        self._group = entry_point_group
        self._added: dict[str, type[Strategy] | str] = {}
        self._plugins: dict[str, _plugins.Plugin] | None = None
        self._claimed: dict[str, str] = {}  # a name several plugins claim -> the problem line
        self._scan_problems: list[str] = []
        self._classes: dict[str, type[Strategy]] = {}
        self._broken: dict[str, str] = {}  # plugin name -> its problem line

    # ------------------------------------------------------------------ registration
    def register(self, name: str, strategy: type[Strategy] | str, *, replace: bool = False) -> None:
        """Make ``name`` resolve to ``strategy`` (a class, or ``"module:Class"`` imported later).

        Raises:
            ConfigurationError: an invalid or built-in name, a class that is no usable
                Strategy, or a name already registered to something else (unless ``replace``).
        """
        reason = _plugins.check_name(name) if isinstance(name, str) else "it is not a str"
        if reason is not None:
            raise ConfigurationError(f"cannot register strategy {name!r}: {reason}")
        if name in self._builtins:
            raise ConfigurationError(
                f"cannot register strategy {name!r}: it is a built-in strategy "
                f"({self._builtins[name]}); register yours under another name"
            )
        if isinstance(strategy, str):
            if strategy.count(":") != 1 or strategy.startswith(":") or strategy.endswith(":"):
                raise ConfigurationError(
                    f"cannot register strategy {name!r}: {strategy!r} is not 'module:Class'"
                )
        else:
            reason = _plugins.check_class(strategy, name)
            if reason is not None:
                raise ConfigurationError(f"cannot register strategy {name!r}: {reason}")
        current = self._added.get(name)
        if current is not None and current != strategy and not replace:
            raise ConfigurationError(
                f"strategy {name!r} is already registered as {_describe(current)}; pass "
                "replace=True to register another"
            )
        self._added[name] = strategy
        self._classes.pop(name, None)

    def unregister(self, name: str) -> None:
        """Undo :meth:`register` for ``name`` (built-ins and plugins cannot be removed)."""
        if name not in self._added:
            raise ConfigurationError(
                f"strategy {name!r} was not added with register(); registered: "
                f"{', '.join(sorted(self._added)) or 'none'}"
            )
        del self._added[name]
        self._classes.pop(name, None)

    # ------------------------------------------------------------------ lookup
    def names(self) -> list[str]:
        """Every strategy name, sorted (plugins included, those left out excluded)."""
        builtins = [name for name, target in self._builtins.items() if _module_exists(target)]
        plugins = self._visible_plugins()  # reads the entry points, and the names claimed twice
        return sorted({*builtins, *self._added, *plugins, *self._claimed})

    def resolve(self, name: str) -> type[Strategy]:
        """The class registered under ``name`` (case and surrounding spaces do not matter).

        Raises:
            UnknownStrategyError: ``name`` is not registered; the message suggests the
                closest name.
            StrategyPluginError: the plugin (or ``register()``-ed target) behind ``name``
                cannot be loaded; one line naming its distribution and the fix.
        """
        if not isinstance(name, str):
            raise UnknownStrategyError(
                f"strategy must be a name or a distkit.Strategy instance, got "
                f"{type(name).__name__} {name!r}. Available: {', '.join(['auto', *self.names()])}"
            )
        key = name.strip().lower()
        if key in self._classes:
            return self._classes[key]
        if key in self._builtins and _module_exists(self._builtins[key]):
            cls = _plugins.load(self._builtins[key])
            assert isinstance(cls, type)
            return self._remember(key, cls)
        if key in self._added:
            return self._remember(key, self._load_added(key, self._added[key]))
        plugin = self._visible_plugins().get(key)
        if plugin is not None:
            return self._remember(key, self._load_plugin(plugin))
        if key in self._claimed:
            raise StrategyPluginError(self._claimed[key])
        choices = self.names()
        close = difflib.get_close_matches(key, [*choices, "auto"], n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownStrategyError(
            f"unknown strategy {name!r}.{hint} Available: {', '.join(['auto', *choices])}"
        )

    def load_all(self) -> dict[str, type[Strategy]]:
        """Every class that loads: built-ins in table order, then registered ones, then plugins.

        Broken plugins are left out (see :meth:`problems`).
        """
        builtins = [name for name, target in self._builtins.items() if _module_exists(target)]
        classes = {}
        for name in [*builtins, *self._added, *sorted(self._visible_plugins())]:
            try:
                classes[name] = self.resolve(name)
            except StrategyPluginError:
                continue
        return classes

    def problems(self) -> list[str]:
        """One line per plugin left out (those that fail to import once something loaded them)."""
        self._visible_plugins()
        shadowed = [
            str(
                _plugins.PluginProblem(
                    plugin, f"{name!r} is taken by register_strategy()", "Rename it"
                )
            )
            for name, plugin in (self._plugins or {}).items()
            if name in self._added
        ]
        return [*self._scan_problems, *shadowed, *self._broken.values()]

    def origin(self, name: str) -> str:
        """Where ``name`` comes from: ``"built-in"``, ``"register_strategy()"`` or the plugin."""
        if name in self._builtins:
            return "built-in"
        if name in self._added:
            return "register_strategy()"
        plugin = self._visible_plugins().get(name)
        return plugin.origin if plugin is not None else "unknown"

    def libraries(self, strategy: type[Strategy] | None = None) -> list[str]:
        """The distributions the built-ins (and ``strategy``) run on beyond torch, in order."""
        names = [n for n, t in self._builtins.items() if _module_exists(t)]
        classes = [self.resolve(name) for name in names]
        if strategy is not None:
            classes.append(strategy)
        return list(dict.fromkeys(lib for cls in classes for lib in cls.libraries))

    # ------------------------------------------------------------------ "auto"
    def auto_candidates(self) -> list[tuple[str, type[Strategy]]]:
        """The built-in and registered classes that ``"auto"`` may pick, in the order it tries."""
        return list(self._auto_candidates())

    def _auto_candidates(self) -> Iterator[tuple[str, type[Strategy]]]:
        names = [n for n, t in self._builtins.items() if _module_exists(t)] + list(self._added)
        for name in names:  # one at a time: "auto" imports no more modules than it needs
            cls = self.resolve(name)
            if cls.auto_select:
                yield name, cls

    def auto_name(self, env: LaunchEnv) -> str:
        """The strategy that fits how this process was launched.

        The first ``auto_select`` class whose launcher family recognises ``env`` (built-ins
        first, then registered ones, then plugins). With distkit's own: torchrun /
        ``torch.distributed.launch``, a SLURM step, a Kubeflow PyTorchJob's replicas (one
        process per pod) or a process group the user made -> the
        torch launchers' strategy; horovodrun -> Horovod's; mpirun -> Horovod's where Horovod
        is installed, else the torch launchers'; a plain process -> the single-process one.
        """
        for check in ("recognises", "accepts"):  # its own launcher first, then one it runs under
            for name, cls in self._auto_candidates():
                if getattr(cls.launcher, check)(env):
                    return name
            for name, cls in self.load_all().items():
                if cls.auto_select and getattr(cls.launcher, check)(env):
                    return name
        raise ConfigurationError(
            f"strategy='auto': no registered strategy runs under {env.launcher}; name one "
            f"instead: {', '.join(self.names())}"
        )

    # ------------------------------------------------------------------ internals
    def _remember(self, name: str, cls: type[Strategy]) -> type[Strategy]:
        self._classes[name] = cls
        return cls

    def _load_added(self, name: str, strategy: type[Strategy] | str) -> type[Strategy]:
        if not isinstance(strategy, str):
            return strategy
        loaded = _plugins.load_class(strategy, name)
        if isinstance(loaded, str):
            raise StrategyPluginError(
                f"strategy {name!r}, registered with register_strategy({name!r}, "
                f"{strategy!r}), cannot be used: {loaded}"
            )
        return loaded

    def _load_plugin(self, plugin: _plugins.Plugin) -> type[Strategy]:
        loaded = _plugins.load_class(plugin.target, plugin.name)
        if isinstance(loaded, str):
            line = str(_plugins.PluginProblem(plugin, loaded))
            self._broken[plugin.name] = line
            raise StrategyPluginError(line)
        return loaded

    def _visible_plugins(self) -> dict[str, _plugins.Plugin]:
        """The plugins whose names are free, read from the entry points on first call."""
        if self._plugins is None:
            self._plugins = {}
            found, self._scan_problems = (
                _plugins.discover(self._group) if self._group is not None else ([], [])
            )
            fix = f'Rename its entry point in [project.entry-points."{self._group}"]'
            claims: dict[str, list[_plugins.Plugin]] = {}
            for plugin in found:
                reason = _plugins.check_name(plugin.name)
                if reason is None and plugin.name in self._builtins:
                    reason = f"{plugin.name!r} is a built-in strategy"
                if reason is not None:
                    self._scan_problems.append(str(_plugins.PluginProblem(plugin, reason, fix)))
                else:
                    claims.setdefault(plugin.name, []).append(plugin)
            for name, plugins in claims.items():
                if len(plugins) == 1:
                    self._plugins[name] = plugins[0]
                else:  # which one the entry points list first is an accident of sys.path
                    self._claimed[name] = _claimed_twice(name, plugins, self._group)
                    self._scan_problems.append(self._claimed[name])
        return {name: p for name, p in self._plugins.items() if name not in self._added}


def _claimed_twice(name: str, plugins: list[_plugins.Plugin], group: str | None) -> str:
    """One line: the plugins that claim ``name``, that none is used, and the fix."""
    claims = [f"{p.distribution} {p.version} ({p.name} = {p.target})" for p in plugins]
    listed = ", ".join(claims[:-1]) + f" and {claims[-1]}"
    uninstall = " or ".join(f"pip uninstall {p.distribution}" for p in plugins)
    return (
        f"strategy plugin {name!r} is left out: {len(plugins)} plugins claim that name, "
        f"{listed}, and distkit cannot tell which you mean, so it uses none. Uninstall all "
        f"but one ({uninstall}), or rename the entry point in one of them "
        f'([project.entry-points."{group}"])'
    )


def _describe(strategy: type[Strategy] | str) -> str:
    return strategy if isinstance(strategy, str) else f"{strategy.__module__}:{strategy.__name__}"


def _module_exists(target: str) -> bool:
    module = target.split(":", 1)[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


#: the registry that ``Trainer(strategy=name)``, :func:`available_strategies` and the
#: ``distkit`` command use in this process
DEFAULT_REGISTRY = StrategyRegistry()


def register_strategy(name: str, strategy: type[Strategy] | str, *, replace: bool = False) -> None:
    """Make ``distkit.Trainer(strategy=name)`` build ``strategy`` in this process.

    It registers in distkit's default registry, which every ``Trainer`` created afterwards in
    this process, :func:`available_strategies` and ``strategy="auto"`` consult; it lasts until
    the process ends (or ``DEFAULT_REGISTRY.unregister(name)``). Other processes, the ranks
    that torchrun starts and the ``distkit`` command included, do not see it: register in the
    training script itself (it runs on every rank), or ship the class as a plugin, with a
    ``distkit.strategies`` entry point, which every process sees.

    Args:
        name: the strategy's name: lowercase, not a built-in's, equal to the class's ``name``.
        strategy: a :class:`~distkit.Strategy` subclass, or ``"module:Class"`` to import on
            first use.
        replace: allow replacing a class registered earlier under ``name``.

    Raises:
        ConfigurationError: an invalid or built-in name, a class that is no usable Strategy,
            or a name already registered to something else (without ``replace``).
    """
    DEFAULT_REGISTRY.register(name, strategy, replace=replace)


def available_strategies() -> list[str]:
    """The registered strategy names, plugins included, sorted (``"auto"`` is accepted too).

    A plugin is listed without being imported; one that fails to import raises
    :class:`~distkit.StrategyPluginError` when it is used, naming its distribution.
    """
    return DEFAULT_REGISTRY.names()


def resolve_strategy_class(name: str) -> type[Strategy]:
    """The class registered under ``name`` in the default registry.

    Raises:
        UnknownStrategyError: ``name`` is not registered; the message suggests the closest name.
        StrategyPluginError: the plugin behind ``name`` cannot be loaded.
    """
    return DEFAULT_REGISTRY.resolve(name)


def auto_strategy_name(env: LaunchEnv) -> str:
    """The strategy ``"auto"`` picks in the default registry for a process launched as
    ``env`` says."""
    return DEFAULT_REGISTRY.auto_name(env)


def make_strategy(strategy: str | Strategy) -> Strategy:
    """A strategy instance from a name (``"auto"`` follows the launcher) or an instance,
    holding the default registry's answers for its messages (``strategy.choices``)."""
    from distkit.strategies.base import Strategy

    if isinstance(strategy, Strategy):
        strategy.choices = DEFAULT_CHOICES
        return strategy
    if isinstance(strategy, str) and strategy.strip().lower() == "auto":
        env = LaunchEnv.detect()
        strategy = auto_strategy_name(env)
        if env.launcher == "mpirun" and env.rank == 0:  # two backends run there: say which
            print(
                f"distkit: strategy='auto' under mpirun runs {strategy!r} ('horovod' where "
                "Horovod is built with MPI, else 'ddp'); pass strategy=... to choose",
                file=sys.stderr,
                flush=True,
            )
    made = resolve_strategy_class(strategy)()
    made.choices = DEFAULT_CHOICES
    return made


class RegistryChoices:
    """A registry's answers for the messages of the layers below it, asked when a message
    needs one (:class:`distkit.launch._choices.StrategyChoices`); None: the default
    registry's, as it is when asked."""

    def __init__(self, registry: StrategyRegistry | None = None) -> None:
        self._given = registry

    @property
    def _registry(self) -> StrategyRegistry:
        return DEFAULT_REGISTRY if self._given is None else self._given

    def auto_name(self, env: LaunchEnv) -> str:
        return self._registry.auto_name(env)

    def keeping_placed_models(self) -> list[str]:
        return [
            name for name, cls in self._registry.load_all().items() if cls.placement_refusal is None
        ]

    def multi_process(self) -> list[str]:
        from distkit.launch.families import SingleProcess

        return [
            name
            for name, cls in self._registry.auto_candidates()
            if not isinstance(cls.launcher, SingleProcess)
        ]


#: the default registry's answers, which every strategy :func:`make_strategy` hands out holds
DEFAULT_CHOICES = RegistryChoices()
