"""``distkit doctor``: which strategies work here, why not, and the command that fixes it.

:func:`examine` gathers this machine's facts once, then asks every registered strategy class,
plugins included, for its verdict (:meth:`Strategy.diagnose <distkit.Strategy.diagnose>`). A
strategy probes its own backend there, without importing it; a plugin that cannot be loaded, or
whose ``diagnose()`` raises, becomes one line, and the other strategies are still examined. The
two renderers are pure functions of what :func:`examine` returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from distkit.errors import DistkitError
from distkit.launch import BUILTIN_CHOICES
from distkit.launch._env import LaunchEnv
from distkit.launch.diagnosis import MachineFacts, StrategyReport, collect_machine
from distkit.launch.families import SingleProcess
from distkit.registry import DEFAULT_REGISTRY, RegistryChoices, StrategyRegistry


@dataclass(frozen=True)
class Checkup:
    """What :func:`examine` found.

    Attributes:
        machine: torch, CUDA and the launcher.
        reports: one verdict per examined strategy, built-ins first.
        plugin_problems: one line per plugin left out (names its distribution).
        auto: what ``strategy="auto"`` picks in this process (or why it cannot pick).
        single_process: the strategies that run as one plain process (``distkit run`` takes
            no ``-n`` for them).
    """

    machine: MachineFacts
    reports: dict[str, StrategyReport]
    plugin_problems: list[str]
    auto: str
    single_process: list[str]


def examine(
    names: Sequence[str] | None = None,
    *,
    registry: StrategyRegistry | None = None,
    machine: MachineFacts | None = None,
) -> Checkup:
    """Every registered strategy's verdict on this machine (only ``names``, if given)."""
    registry = DEFAULT_REGISTRY if registry is None else registry
    machine = collect_machine(RegistryChoices(registry)) if machine is None else machine
    classes = registry.load_all()
    selected = [n for n in classes if names is None or n in names]
    reports = {}
    for name in selected:
        try:
            report = classes[name].diagnose(machine)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # one broken check (even a sys.exit) must not hide the others
            qualname = f"{classes[name].__module__}.{classes[name].__qualname__}"
            report = StrategyReport(
                name,
                False,
                f"{qualname}.diagnose() raised {type(exc).__name__}: {exc}",
                ["its check failed"],
                f"report it to the maintainers of {registry.origin(name)}",
            )
        reports[name] = dataclasses.replace(report, name=name, origin=registry.origin(name))
    try:
        auto = registry.auto_name(machine.launcher)
    except DistkitError as exc:
        auto = f"nothing ({exc})"
    if machine.launcher_problem:
        auto = f"nothing ({machine.launcher_problem})"
    single = [n for n, cls in classes.items() if isinstance(cls.launcher, SingleProcess)]
    return Checkup(machine, reports, registry.problems(), auto, single)


def to_json(checkup: Checkup) -> dict[str, Any]:
    """A JSON-ready dict: the machine's facts, ``"auto"``, ``"strategies": {name: report}``
    and ``"plugin_problems"``."""
    # the facts, not the registry answers the verdicts were worded with (no data: a view)
    plain = dataclasses.replace(checkup.machine, choices=BUILTIN_CHOICES)
    data = {key: value for key, value in asdict(plain).items() if key != "choices"}
    data["auto"] = checkup.auto
    data["strategies"] = {name: asdict(report) for name, report in checkup.reports.items()}
    data["plugin_problems"] = list(checkup.plugin_problems)
    return data


def _launcher_words(env: LaunchEnv) -> str:
    """The launcher, and the pod it runs in (``"torchrun in a Kubeflow job's pod"``)."""
    if env.pod is None or env.launcher == "kubeflow":
        return env.launcher
    return f"{env.launcher} in a {_POD_WORDS[env.pod]}"


_POD_WORDS = {"kubeflow": "Kubeflow job's pod", "kubernetes": "Kubernetes pod"}


def render_text(checkup: Checkup) -> str:
    """The report as aligned lines."""
    machine, env = checkup.machine, checkup.machine.launcher
    cuda = f"CUDA: {machine.cuda_devices} device(s)" if machine.cuda_devices else "CUDA: no"
    yes = {True: "yes", False: "no"}
    lines = [
        f"python    {machine.python}",
        f"torch     {machine.torch_version}  {cuda}  NCCL: {yes[machine.nccl]}  "
        f"Gloo: {yes[machine.gloo]}",
        f"launcher  {_launcher_words(env)} (rank {env.rank} of {env.world_size})  ->  "
        f"strategy='auto' picks {checkup.auto}",
        "",
    ]
    width = max([8, *(len(name) for name in checkup.reports)])
    indent = " " * (width + 13)
    for report in checkup.reports.values():
        verdict = "usable" if report.usable else "NOT usable"
        origin = "" if report.origin == "built-in" else f"  [{report.origin}]"
        lines.append(f"{report.name:<{width}} {verdict:<10}  {report.summary}{origin}")
        if report.why_not:
            lines.append(f"{indent}why not: {'; '.join(report.why_not)}")
        if report.fix:
            lines.append(f"{indent}fix: {report.fix}")
    if checkup.plugin_problems:
        lines.append("\nplugins left out (the other strategies are not affected):")
        lines += [f"  {problem}" for problem in checkup.plugin_problems]
    launch = "\nlaunch: distkit run --strategy NAME -n N script.py"
    if checkup.single_process:
        launch += f"  ({', '.join(checkup.single_process)}: one process, no -n)"
    lines.append(launch)
    return "\n".join(lines)
