"""Launcher families and ``distkit doctor``'s types, at their public path: the code is
:mod:`distkit.launch.families` and :mod:`distkit.launch.diagnosis`.

Strategy authors name a family here (``launcher = distkit.launchers.TORCH_LAUNCHERS``, or a
:class:`LauncherFamily` of their own) and answer ``diagnose(machine: MachineFacts)`` with a
:class:`StrategyReport`; see ``docs/plugins.md``.
"""

from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.launch.families import (
    SINGLE_PROCESS,
    TORCH_LAUNCHERS,
    LauncherFamily,
    SingleProcess,
    TorchLaunchers,
    own_process_group,
)

__all__ = [
    "SINGLE_PROCESS",
    "TORCH_LAUNCHERS",
    "LauncherFamily",
    "MachineFacts",
    "SingleProcess",
    "StrategyReport",
    "TorchLaunchers",
    "own_process_group",
]
