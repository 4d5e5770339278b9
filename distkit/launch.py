"""The command line that starts a training script under the launcher its strategy needs.

Everything here except :func:`horovod_controller` is a pure function of its arguments, so the
commands ``distkit run`` builds can be checked without starting anything.

Process counts follow torchrun: ``nproc_per_node`` (``distkit run -n``) processes on each node.

* ``ddp`` / ``apex`` -> ``python -m torch.distributed.run`` (torchrun, with this interpreter):
  ``--standalone`` on one node; on several, the same command runs on every node with
  ``--nnodes``, ``--node_rank``, ``--master_addr`` (and ``--master_port``).
* ``horovod`` -> ``horovodrun -np TOTAL -H host:slots,...``, started once, on one node
  (horovodrun reaches the other hosts itself). One node: ``-H localhost:N``. Hosts listed
  without ``:slots`` get ``nproc_per_node`` slots each; ``-np`` is the sum of the slots.
* ``dp`` -> ``python script.py``: nn.DataParallel is one process, whatever the GPU count.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distkit.errors import ConfigurationError

LAUNCHERS: dict[str, str] = {
    "apex": "torchrun",
    "ddp": "torchrun",
    "dp": "python",
    "horovod": "horovodrun",
}
CONTROLLER_FLAGS = ("--gloo", "--mpi", "--jsrun")  # horovodrun's controller switches


@dataclass(frozen=True)
class LaunchRequest:
    """What ``distkit run`` was asked to start.

    Attributes:
        strategy: one of :data:`LAUNCHERS`.
        script: the training script's path.
        script_args: the script's own arguments, passed through untouched.
        nproc_per_node: processes on each node (torchrun's ``--nproc_per_node``).
        nnodes: how many nodes take part.
        node_rank: this node's rank (torchrun, several nodes).
        master_addr: the rendezvous host (torchrun, several nodes).
        master_port: the rendezvous port (torchrun; its default is 29500).
        hosts: horovodrun's host list, ``"host1,host2"`` or ``"host1:4,host2:4"``.
        launcher_args: extra arguments for torchrun or horovodrun, placed before the script.
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


def with_strategy_arg(args: Sequence[str], strategy: str) -> list[str]:
    """``args`` plus ``--strategy <strategy>``, unless the user already passed ``--strategy``.

    It goes at the end, or before a ``--`` (after which the script's parser takes no options).
    """
    end = args.index("--") if "--" in args else len(args)
    if any(a == "--strategy" or a.startswith("--strategy=") for a in args[:end]):
        return list(args)
    return [*args[:end], "--strategy", strategy, *args[end:]]


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


def world_size(request: LaunchRequest) -> int:
    """The total number of processes ``request`` starts."""
    if request.strategy == "horovod" and request.hosts:
        return sum(n for _, n in parse_hosts(request.hosts, request.nproc_per_node))
    return request.nproc_per_node * request.nnodes


def torchrun_command(request: LaunchRequest, python: str) -> list[str]:
    """``python -m torch.distributed.run ...`` for ``request`` (ddp, apex)."""
    if request.hosts:
        raise ConfigurationError(
            f"-H is horovodrun's host list; strategy={request.strategy!r} runs under torchrun: "
            "run the same `distkit run` on every node with --nnodes, --node-rank and --master-addr"
        )
    cmd = [python, "-m", "torch.distributed.run"]
    single = request.nnodes == 1
    if single and request.master_addr is None and request.master_port is None:
        if request.node_rank not in (None, 0):
            raise ConfigurationError(
                f"--node-rank {request.node_rank} needs a multi-node run: add --nnodes and "
                "--master-addr"
            )
        cmd.append("--standalone")
    else:
        node_rank = 0 if single and request.node_rank is None else request.node_rank
        master_addr = "127.0.0.1" if single and request.master_addr is None else request.master_addr
        if master_addr is None or node_rank is None:
            raise ConfigurationError(
                f"--nnodes {request.nnodes} needs --master-addr (the host of node 0) and "
                "--node-rank (0 on that host, 1.. on the others): run the same command on every "
                "node, e.g. --nnodes 2 --node-rank 0 --master-addr node1"
            )
        if not 0 <= node_rank < request.nnodes:
            raise ConfigurationError(
                f"--node-rank {node_rank} is outside 0..{request.nnodes - 1} "
                f"(--nnodes {request.nnodes})"
            )
        cmd += ["--nnodes", str(request.nnodes), "--node_rank", str(node_rank)]
        cmd += ["--master_addr", master_addr]
        if request.master_port is not None:
            cmd += ["--master_port", str(request.master_port)]
    cmd += ["--nproc_per_node", str(request.nproc_per_node), *request.launcher_args]
    return [*cmd, request.script, *with_strategy_arg(request.script_args, request.strategy)]


def horovodrun_command(
    request: LaunchRequest, python: str, horovodrun: str, controller: str | None = None
) -> list[str]:
    """``horovodrun -np TOTAL -H host:slots,... [--gloo|--mpi] python script ...``.

    Args:
        request: what to start (strategy ``"horovod"``).
        python: the interpreter every rank runs.
        horovodrun: the horovodrun executable.
        controller: ``"gloo"`` or ``"mpi"`` to pass explicitly; None lets horovodrun choose.
    """
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
            f"{', '.join(torch_only)} are torchrun options; horovodrun starts every node from "
            "this one: run `distkit run` once, listing the nodes with -H node1,node2"
        )
    if request.hosts is None and request.nnodes > 1:
        raise ConfigurationError(
            f"--nnodes {request.nnodes} with strategy='horovod' needs the host list: -H "
            f"node1,node2 (each gets -n {request.nproc_per_node} processes) or -H node1:4,node2:4"
        )
    hosts = parse_hosts(request.hosts or "localhost", request.nproc_per_node)
    if request.hosts is not None and request.nnodes not in (1, len(hosts)):
        raise ConfigurationError(
            f"--nnodes {request.nnodes} but -H lists {len(hosts)} hosts ({request.hosts})"
        )
    host_list = ",".join(f"{name}:{n}" for name, n in hosts)
    cmd = [horovodrun, "-np", str(sum(n for _, n in hosts)), "-H", host_list]
    if controller is not None and not set(CONTROLLER_FLAGS) & set(request.launcher_args):
        cmd.append(f"--{controller}")
    cmd += [*request.launcher_args, python, request.script]
    return [*cmd, *with_strategy_arg(request.script_args, request.strategy)]


def python_command(request: LaunchRequest, python: str) -> list[str]:
    """``python script ...`` for the single-process strategy (dp)."""
    extra = [
        flag
        for flag, given in (
            ("-n", request.nproc_per_node != 1),
            ("--nnodes", request.nnodes != 1),
            ("--node-rank", request.node_rank is not None),
            ("--master-addr", request.master_addr is not None),
            ("--master-port", request.master_port is not None),
            ("-H", request.hosts is not None),
            ("launcher arguments", bool(request.launcher_args)),
        )
        if given
    ]
    if extra:
        raise ConfigurationError(
            f"strategy='dp' (nn.DataParallel) is a single process that splits each batch over "
            f"this machine's GPUs; it takes no {', '.join(extra)}. For several processes or "
            f"nodes use --strategy ddp (or horovod), e.g. distkit run --strategy ddp "
            f"-n {max(request.nproc_per_node, 2)} {request.script}"
        )
    return [python, request.script, *with_strategy_arg(request.script_args, request.strategy)]


def build_command(
    request: LaunchRequest,
    *,
    python: str,
    horovodrun: str = "horovodrun",
    controller: str | None = None,
) -> list[str]:
    """The argv that starts ``request``.

    Raises:
        ConfigurationError: an unknown strategy, a count below 1, or options that do not fit
            the strategy's launcher (the message says which to use instead).
    """
    if request.strategy not in LAUNCHERS:
        raise ConfigurationError(
            f"distkit run cannot launch strategy {request.strategy!r}; choose one of "
            f"{', '.join(sorted(LAUNCHERS))}"
        )
    if request.nproc_per_node < 1 or request.nnodes < 1:
        raise ConfigurationError(
            f"-n and --nnodes must be >= 1, got -n {request.nproc_per_node} "
            f"--nnodes {request.nnodes}"
        )
    launcher = LAUNCHERS[request.strategy]
    if launcher == "torchrun":
        return torchrun_command(request, python)
    if launcher == "horovodrun":
        return horovodrun_command(request, python, horovodrun, controller)
    return python_command(request, python)


def thread_env(request: LaunchRequest, environ: Mapping[str, str]) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": "1"}`` for a multi-process run whose user did not set it, else ``{}``.

    Several processes each running one OpenMP thread per core oversubscribe the CPUs.
    """
    if world_size(request) > 1 and "OMP_NUM_THREADS" not in environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def describe(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """One shell line: ``VAR=value ... argv``, quoted so it can be pasted into a shell."""
    return shlex.join([*(f"{key}={value}" for key, value in env.items()), *argv])


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
