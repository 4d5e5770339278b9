"""How processes start: what a launcher told this one, and the command ``distkit run`` builds.

The package: :mod:`._env` (the launcher's variables: rank, world, node), :mod:`._hostlist`
(SLURM's node lists), :mod:`._spawn` (``distkit.spawn``: processes from a notebook or a
script), :mod:`._choices` (the registry's answers, handed down for messages); the
launcher families themselves are :mod:`distkit.launchers` (public: plugins name theirs).
This module holds the command line ``distkit run`` starts: the strategy's family builds it.

Everything here is a pure function of its arguments (the strategy class among them: the
command line's caller resolves it in the registry), so the commands ``distkit run`` builds
can be checked without starting anything. Which launcher a strategy runs under, and how
its command looks, is the strategy class's to say (:attr:`Strategy.launcher
<distkit.Strategy.launcher>`, see :mod:`distkit.launchers`).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from distkit.errors import ConfigurationError
from distkit.launch._choices import BUILTIN_CHOICES, StrategyChoices, native_alternative

if TYPE_CHECKING:
    from distkit.launch.families import LauncherFamily


@dataclass(frozen=True)
class LaunchRequest:
    """What ``distkit run`` was asked to start.

    Attributes:
        strategy: a registered strategy name.
        script: the training script's path.
        script_args: the script's own arguments, passed through untouched.
        nproc_per_node: processes on each node (torchrun's ``--nproc_per_node``).
        nnodes: how many nodes take part.
        node_rank: this node's rank (torchrun, several nodes).
        master_addr: the rendezvous host (torchrun, several nodes).
        master_port: the rendezvous port (torchrun; its default is 29500).
        hosts: horovodrun's host list, ``"host1,host2"`` or ``"host1:4,host2:4"``.
        launcher_args: extra arguments for the launcher, placed before the script.
        choices: the registry's answers, for messages that suggest another strategy
            (``distkit run`` passes them; see :mod:`distkit.launch._choices`).
    """

    strategy: str
    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    hosts: str | None = None
    launcher_args: tuple[str, ...] = ()
    choices: StrategyChoices = field(default=BUILTIN_CHOICES, compare=False, repr=False)


class Launchable(Protocol):
    """What the command line asks of a strategy class (:class:`distkit.Strategy` has it)."""

    launcher: LauncherFamily

    def launch_command(
        self, request: LaunchRequest, *, python: str, tools: Mapping[str, str]
    ) -> list[str]: ...


def with_strategy_arg(args: Sequence[str], strategy: str) -> list[str]:
    """``args`` plus ``--strategy <strategy>``, unless the user already passed ``--strategy``.

    It goes at the end, or before a ``--`` (after which the script's parser takes no options).
    """
    end = args.index("--") if "--" in args else len(args)
    if any(a == "--strategy" or a.startswith("--strategy=") for a in args[:end]):
        return list(args)
    return [*args[:end], "--strategy", strategy, *args[end:]]


def build_command(
    request: LaunchRequest,
    strategy: Launchable,
    *,
    python: str,
    tools: Mapping[str, str] | None = None,
) -> list[str]:
    """The argv that starts ``request``, as its strategy class builds it.

    Args:
        request: what to start.
        strategy: the class registered under ``request.strategy``.
        python: the interpreter every rank runs.
        tools: what the launcher family found on this machine
            (:meth:`LauncherFamily.find_tools <distkit.launch.families.LauncherFamily.find_tools>`);
            None checks the options without it.

    Raises:
        ConfigurationError: a count below 1, or options that do not fit the strategy's
            launcher (the message says which to use instead).
    """
    if request.nproc_per_node < 1 or request.nnodes < 1:
        raise ConfigurationError(
            f"-n and --nnodes must be >= 1, got -n {request.nproc_per_node} "
            f"--nnodes {request.nnodes}"
        )
    port = request.master_port
    if port is not None and not 1 <= port <= 65535:
        raise ConfigurationError(
            f"--master-port {port} is not a TCP port: give one from 1 to 65535 (torchrun's "
            "default is 29500), or leave it out"
        )
    return strategy.launch_command(request, python=python, tools=tools or {})


def world_size(request: LaunchRequest, strategy: Launchable) -> int:
    """The total number of processes ``request`` starts under ``strategy``'s launcher."""
    return strategy.launcher.world_size(request)


def thread_env(
    request: LaunchRequest, strategy: Launchable, environ: Mapping[str, str]
) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": "1"}`` for a multi-process run whose user did not set it, else ``{}``.

    Several processes each running one OpenMP thread per core oversubscribe the CPUs.
    """
    if world_size(request, strategy) > 1 and "OMP_NUM_THREADS" not in environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def describe(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """One shell line: ``VAR=value ... argv``, quoted so it can be pasted into a shell."""
    return shlex.join([*(f"{key}={value}" for key, value in env.items()), *argv])


__all__ = [
    "BUILTIN_CHOICES",
    "LaunchRequest",
    "Launchable",
    "StrategyChoices",
    "build_command",
    "describe",
    "native_alternative",
    "thread_env",
    "with_strategy_arg",
    "world_size",
]
