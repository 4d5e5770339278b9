"""What ``distkit doctor`` asks of every strategy class: this machine's facts in, a verdict out.

A strategy answers in :meth:`Strategy.diagnose(machine) <distkit.Strategy.diagnose>`;
:class:`MachineFacts` is what every strategy may look at, gathered once by
:func:`collect_machine`. A strategy that needs more (a library's version, a launcher's
self-check) probes it itself, and puts what it found in :attr:`StrategyReport.details`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from distkit.launch._choices import BUILTIN_CHOICES, StrategyChoices
from distkit.launch._env import LaunchEnv


@dataclass(frozen=True)
class MachineFacts:
    """torch, CUDA and the launcher as this process sees them.

    ``launcher_problem`` is why the launcher's variables cannot start a run (a Kubeflow pod
    set up for torchrun running plain ``python``, a rank outside the world); ``launcher`` is
    then a plain process. ``choices`` names the strategies a verdict may suggest instead (the
    registry's answers; ``distkit doctor`` passes them).
    """

    python: str
    torch_version: str
    cuda_devices: int  # 0 when CUDA is not available
    distributed: bool
    nccl: bool
    gloo: bool
    launcher: LaunchEnv
    launcher_problem: str | None = None
    choices: StrategyChoices = field(default=BUILTIN_CHOICES, compare=False, repr=False)


@dataclass(frozen=True)
class StrategyReport:
    """One strategy's verdict on this machine.

    Attributes:
        name: the strategy's registered name.
        usable: whether it can train here.
        summary: one line: what was found.
        why_not: the reasons it cannot (empty when usable).
        fix: one command that fixes it, or the alternative where none exists.
        details: what the strategy probed (versions, a launcher's self-check), JSON-ready.
        origin: ``"built-in"``, or the plugin distribution it comes from (set by the doctor).
    """

    name: str
    usable: bool
    summary: str
    why_not: list[str] = field(default_factory=list)
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    origin: str = "built-in"


def collect_machine(choices: StrategyChoices = BUILTIN_CHOICES) -> MachineFacts:
    """Look at torch, CUDA, NCCL, Gloo and the launcher (imports no backend library);
    ``choices``: the registry's answers, for the verdicts' suggestions."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available()
    try:
        launcher, problem = LaunchEnv.detect(), None
    except ValueError as exc:  # ConfigurationError too: the doctor reports it, and goes on
        launcher, problem = LaunchEnv(), str(exc)
    return MachineFacts(
        python=sys.executable,
        torch_version=str(torch.__version__),
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        distributed=distributed,
        nccl=distributed and dist.is_nccl_available(),
        gloo=distributed and dist.is_gloo_available(),
        launcher=launcher,
        launcher_problem=problem,
        choices=choices,
    )
