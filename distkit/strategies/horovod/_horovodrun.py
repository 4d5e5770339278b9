"""Horovod's launcher family: horovodrun (or mpirun), started once, on one node.

``distkit run`` starts ``horovodrun -np TOTAL -H host:slots,...``; horovodrun reaches the other
hosts itself. One node: ``-H localhost:N``. Hosts listed without ``:slots`` get
``nproc_per_node`` slots each; ``-np`` is the sum of the slots.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from typing_extensions import override

from distkit._imports import is_importable
from distkit.errors import ConfigurationError, MissingDependencyError
from distkit.launch import LaunchRequest, with_strategy_arg
from distkit.launch._env import LaunchEnv
from distkit.launch.families import LauncherFamily, own_process_group

CONTROLLER_FLAGS = ("--gloo", "--mpi", "--jsrun")  # horovodrun's controller switches


def parse_hosts(hosts: str, slots: int) -> list[tuple[str, int]]:
    """``"a,b:4"`` -> ``[("a", slots), ("b", 4)]``.

    Raises:
        ConfigurationError: an empty host name or a slot count that is not a positive integer.
    """
    parsed = []
    for entry in hosts.split(","):
        name, sep, count = entry.strip().partition(":")
        if not name or (sep and not (count.isdigit() and int(count) > 0)):
            raise ConfigurationError(
                f"-H {hosts!r}: {entry!r} is not 'host' or 'host:slots' (slots a positive "
                "integer); write e.g. -H node1:4,node2:4"
            )
        parsed.append((name, int(count) if sep else slots))
    return parsed


def horovod_has_mpi() -> bool:
    """Whether an installed Horovod was built with MPI (imports it: ask only under mpirun)."""
    if not is_importable("horovod.torch"):
        return False
    try:
        import horovod.torch as hvd

        return bool(hvd.mpi_built())
    except Exception:  # a broken install: not a Horovod that runs here
        return False


class Horovodrun(LauncherFamily):
    """horovodrun, or mpirun, which Horovod also runs under.

    :meth:`command` reads ``tools["horovodrun"]`` (default ``"horovodrun"``) and
    ``tools["controller"]`` (``"gloo"`` or ``"mpi"`` to pass explicitly; absent lets
    horovodrun choose).
    """

    launcher = "horovodrun"
    args_option = "--horovod-args"

    @override
    def recognises(self, env: LaunchEnv) -> bool:
        if own_process_group():
            return False
        # plain mpirun runs Horovod only where Horovod was built with MPI (else "auto" takes
        # ddp: a Gloo-only Horovod under mpirun would run every process alone)
        return env.launcher == "horovodrun" or (env.launcher == "mpirun" and horovod_has_mpi())

    @override
    def world_size(self, request: LaunchRequest) -> int:
        if request.hosts:
            return sum(n for _, n in parse_hosts(request.hosts, request.nproc_per_node))
        return super().world_size(request)

    @override
    def command(
        self, request: LaunchRequest, *, python: str, tools: Mapping[str, str]
    ) -> list[str]:
        torch_only = [
            flag
            for flag, value in (
                ("--node-rank", request.node_rank),
                ("--master-addr", request.master_addr),
                ("--master-port", request.master_port),
            )
            if value is not None
        ]
        if torch_only:
            raise ConfigurationError(
                f"{', '.join(torch_only)} are torchrun options; horovodrun starts every node "
                "from this one: run `distkit run` once, listing the nodes with -H node1,node2"
            )
        if request.hosts is None and request.nnodes > 1:
            raise ConfigurationError(
                f"--nnodes {request.nnodes} with strategy={request.strategy!r} needs the host "
                f"list: -H node1,node2 (each gets -n {request.nproc_per_node} processes) or -H "
                "node1:4,node2:4"
            )
        hosts = parse_hosts(request.hosts or "localhost", request.nproc_per_node)
        if request.hosts is not None and request.nnodes not in (1, len(hosts)):
            raise ConfigurationError(
                f"--nnodes {request.nnodes} but -H lists {len(hosts)} hosts ({request.hosts})"
            )
        host_list = ",".join(f"{name}:{n}" for name, n in hosts)
        horovodrun = tools.get("horovodrun", "horovodrun")
        cmd = [horovodrun, "-np", str(sum(n for _, n in hosts)), "-H", host_list]
        controller = tools.get("controller")
        if controller and not set(CONTROLLER_FLAGS) & set(request.launcher_args):
            cmd.append(f"--{controller}")
        cmd += [*request.launcher_args, python, request.script]
        return [*cmd, *with_strategy_arg(request.script_args, request.strategy)]

    @override
    def find_tools(self, request: LaunchRequest) -> dict[str, str]:
        from distkit.horovod_build import horovodrun_path

        try:
            horovodrun = horovodrun_path()
        except MissingDependencyError as exc:
            raise MissingDependencyError(
                f"strategy={request.strategy!r} needs horovodrun, which is missing ({exc}). "
                f"Build and install Horovod for this torch: {sys.executable} -m "
                "distkit.horovod_build"
            ) from exc
        controller = horovod_controller(request.launcher_args, horovodrun)
        tools = {"horovodrun": horovodrun}
        return tools if controller is None else {**tools, "controller": controller}

    @override
    def help_lines(self, names: Sequence[str]) -> list[str]:
        return [
            f"  {', '.join(names)}:",
            "    horovodrun -np N*hosts -H localhost:N [--gloo] python script.py ...",
            "    (several nodes: run once, on one node, with -H node1,node2 or -H node1:4,node2:4;",
            "    -np is the sum of the slots; --gloo unless MPI is built and mpirun is on PATH)",
        ]

    @override
    def examples(self, name: str) -> list[str]:
        return [
            f"distkit run --strategy {name} -n 4 train.py",
            f"distkit run --strategy {name} -n 4 -H node1,node2 train.py",
            f'distkit run --strategy {name} -n 2 --horovod-args="--verbose --mpi" train.py',
        ]


def horovod_controller(
    launcher_args: Sequence[str], horovodrun: str, *, timeout: float = 60.0
) -> str | None:
    """The controller to name for horovodrun: ``"gloo"``, ``"mpi"``, or None.

    None when the user chose one in ``launcher_args`` or ``--check-build`` could not tell.
    Without ``mpirun`` on PATH only Gloo can work, so ``--check-build`` (~6 s) is skipped.
    """
    if set(CONTROLLER_FLAGS) & set(launcher_args):
        return None
    if shutil.which("mpirun") is None:
        return "gloo"
    from distkit.horovod_build import parse_check_build

    try:
        done = subprocess.run(
            [horovodrun, "--check-build"], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    controllers = parse_check_build(done.stdout + done.stderr).get("controllers", {})
    if controllers.get("MPI"):
        return "mpi"
    return "gloo" if controllers.get("Gloo") else None


#: horovodrun, or mpirun
HOROVODRUN = Horovodrun()
