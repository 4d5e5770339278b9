"""Launcher families, at their public path: the code is :mod:`distkit.launch.families`.

Strategy authors name a family here (``launcher = distkit.launchers.TORCH_LAUNCHERS``, or a
:class:`LauncherFamily` of their own); see ``docs/plugins.md``.
"""

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
    "SingleProcess",
    "TorchLaunchers",
    "own_process_group",
]
