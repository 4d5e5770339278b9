"""Launcher families: how the processes of a strategy are started, and how they are recognised.

Every strategy class names its family in :attr:`Strategy.launcher <distkit.Strategy.launcher>`.
The family builds the command ``distkit run`` starts, tells ``strategy="auto"`` whether its
launcher started this process, and gives the ``distkit run --help`` lines. Two families are
here: :data:`TORCH_LAUNCHERS` (torchrun, ``torch.distributed.launch``, or plain ``python`` as a
world of one) and :data:`SINGLE_PROCESS` (plain ``python`` only). A backend with a launcher of
its own defines a :class:`LauncherFamily` beside its strategy (as horovodrun's is).

Process counts follow torchrun: ``nproc_per_node`` (``distkit run -n``) processes on each node.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from typing_extensions import override

from distkit.errors import ConfigurationError
from distkit.launch import LaunchRequest, with_strategy_arg
from distkit.launch._env import LaunchEnv
from distkit.launch.diagnosis import MachineFacts, StrategyReport


class LauncherFamily(ABC):
    """The launchers a strategy runs under, and how ``distkit run`` starts them.

    Attributes:
        launcher: what ``distkit run`` starts, as messages name it (``"torchrun"``).
        args_option: the ``distkit run`` option that passes extra arguments to that launcher
            (``"--torchrun-args"``), or None when it takes none.
    """

    launcher: ClassVar[str]
    args_option: ClassVar[str | None] = None

    @abstractmethod
    def recognises(self, env: LaunchEnv) -> bool:
        """Whether this family's launcher started this process (``strategy="auto"`` asks)."""

    def accepts(self, env: LaunchEnv) -> bool:
        """Whether this family also runs under ``env``'s launcher when no family recognises it
        as its own (``strategy="auto"``'s second choice; default: only its own)."""
        return self.recognises(env)

    @abstractmethod
    def command(
        self, request: LaunchRequest, *, python: str, tools: Mapping[str, str]
    ) -> list[str]:
        """The argv that starts ``request``; a pure function of its arguments.

        Args:
            request: what ``distkit run`` was asked to start.
            python: the interpreter every rank runs.
            tools: what :meth:`find_tools` found (empty for a dry check of the options).

        Raises:
            ConfigurationError: options that do not fit this launcher (the message says which
                to use instead).
        """

    @abstractmethod
    def help_lines(self, names: Sequence[str]) -> list[str]:
        """``distkit run --help`` lines: how strategies ``names`` of this family are started."""

    @abstractmethod
    def examples(self, name: str) -> list[str]:
        """Example ``distkit run`` lines for strategy ``name``."""

    def find_tools(self, request: LaunchRequest) -> dict[str, str]:
        """Look on this machine for what :meth:`command` needs (default: nothing).

        Raises:
            MissingDependencyError: the launcher is missing; the message names the fix.
        """
        return {}

    def world_size(self, request: LaunchRequest) -> int:
        """How many processes ``request`` starts in all."""
        return request.nproc_per_node * request.nnodes

    def diagnose(self, name: str, machine: MachineFacts) -> StrategyReport:
        """``distkit doctor``'s verdict for a strategy that checks nothing beyond its family."""
        return StrategyReport(name, True, f"runs under {self.launcher}")

    @override
    def __repr__(self) -> str:
        return f"<launcher family {self.launcher}>"


class TorchLaunchers(LauncherFamily):
    """torchrun or ``torch.distributed.launch``, a SLURM step (``srun``), a Kubeflow
    PyTorchJob's replicas (one ``python`` per pod), or mpirun when no Horovod claims it; plain
    ``python`` is a world of one.

    ``distkit run`` starts ``python -m torch.distributed.run`` (torchrun, with this
    interpreter): ``--standalone`` on one node; on several, the same command runs on every node
    with ``--nnodes``, ``--node_rank``, ``--master_addr`` (and ``--master_port``).
    """

    launcher = "torchrun"
    args_option = "--torchrun-args"

    @override
    def recognises(self, env: LaunchEnv) -> bool:
        return env.is_torch_launcher or env.launcher in ("srun", "kubeflow") or own_process_group()

    @override
    def accepts(self, env: LaunchEnv) -> bool:
        # under mpirun, torch.distributed meets at MASTER_ADDR:MASTER_PORT (see distkit.launch._env)
        return self.recognises(env) or env.launcher == "mpirun"

    @override
    def command(
        self, request: LaunchRequest, *, python: str, tools: Mapping[str, str]
    ) -> list[str]:
        if request.hosts:
            raise ConfigurationError(
                f"-H is horovodrun's host list; strategy={request.strategy!r} runs under "
                "torchrun: run the same `distkit run` on every node with --nnodes, --node-rank "
                "and --master-addr"
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
            cmd += _rendezvous_args(request)
        _refuse_own_options(request.launcher_args, request.nproc_per_node)
        cmd += ["--nproc_per_node", str(request.nproc_per_node), *request.launcher_args]
        return [*cmd, request.script, *with_strategy_arg(request.script_args, request.strategy)]

    @override
    def help_lines(self, names: Sequence[str]) -> list[str]:
        return [
            f"  {', '.join(names)}:",
            "    python -m torch.distributed.run --standalone --nproc_per_node N script.py ...",
            "    (several nodes: run the same command on each, with --nnodes K --node-rank R",
            "    --master-addr HOST [--master-port P])",
        ]

    @override
    def examples(self, name: str) -> list[str]:
        return [
            f"distkit run --strategy {name} -n 2 train.py --epochs 3",
            f"distkit run --strategy {name} -n 8 --nnodes 2 --node-rank 0 --master-addr node1 "
            "train.py",
            f'distkit run --strategy {name} -n 2 --torchrun-args="--max-restarts 3" train.py',
        ]

    @override
    def diagnose(self, name: str, machine: MachineFacts) -> StrategyReport:
        gpus = machine.cuda_devices
        if gpus and machine.nccl:
            return StrategyReport(name, True, f"backend nccl, {gpus} GPU(s)")
        if machine.gloo:
            return StrategyReport(name, True, f"backend gloo {'(no NCCL)' if gpus else 'on CPU'}")
        why = "torch.distributed is not available" if not machine.distributed else "no gloo backend"
        fix = (
            "install a torch with torch.distributed and gloo (PyPI's Linux wheels have both): "
            f"{machine.python} -m pip install torch=={machine.torch_version.split('+')[0]}"
        )
        return StrategyReport(name, False, f"torch {machine.torch_version}", [why], fix)


def _rendezvous_args(request: LaunchRequest) -> list[str]:
    single = request.nnodes == 1
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
    args = ["--nnodes", str(request.nnodes), "--node_rank", str(node_rank)]
    args += ["--master_addr", master_addr]
    if request.master_port is not None:
        args += ["--master_port", str(request.master_port)]
    return args


class SingleProcess(LauncherFamily):
    """One plain ``python`` process, whatever the GPU count: ``distkit run`` takes no ``-n``."""

    launcher = "python"

    @override
    def recognises(self, env: LaunchEnv) -> bool:
        return not env.is_multiprocess_launcher and not own_process_group()

    @override
    def command(
        self, request: LaunchRequest, *, python: str, tools: Mapping[str, str]
    ) -> list[str]:
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
            multi = request.choices.multi_process()
            instead = f"--strategy {multi[0]}" if multi else "a multi-process strategy"
            if len(multi) > 1:
                instead += f" (or {', '.join(multi[1:])})"
            raise ConfigurationError(
                f"strategy={request.strategy!r} is a single process (one python, however many "
                f"GPUs); it takes no {', '.join(extra)}. For several processes or nodes use "
                f"{instead}, e.g. distkit run --strategy {multi[0] if multi else 'NAME'} "
                f"-n {max(request.nproc_per_node, 2)} {request.script}"
            )
        return [python, request.script, *with_strategy_arg(request.script_args, request.strategy)]

    @override
    def help_lines(self, names: Sequence[str]) -> list[str]:
        return [f"  {', '.join(names)}:", "    python script.py ...  (one process; -n must be 1)"]

    @override
    def examples(self, name: str) -> list[str]:
        return [f"distkit run --strategy {name} --dry-run train.py"]

    @override
    def diagnose(self, name: str, machine: MachineFacts) -> StrategyReport:
        return StrategyReport(name, True, "one process")


def own_process_group() -> bool:
    """A multi-process torch.distributed group the user made (mp.spawn + init_process_group)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


#: torchrun, ``torch.distributed.launch``, or plain ``python`` (a world of one)
TORCH_LAUNCHERS = TorchLaunchers()
#: plain ``python``: one process
SINGLE_PROCESS = SingleProcess()


#: torchrun options ``distkit run`` sets itself, and its own option for each
_OWN_TORCHRUN_OPTIONS = {
    "--nproc_per_node": "-n",
    "--nproc-per-node": "-n",
    "--nnodes": "--nnodes",
    "--node_rank": "--node-rank",
    "--node-rank": "--node-rank",
    "--master_addr": "--master-addr",
    "--master-addr": "--master-addr",
    "--master_port": "--master-port",
    "--master-port": "--master-port",
    "--standalone": "(nothing: a one-node run is standalone)",
}


def _refuse_own_options(launcher_args: Sequence[str], nproc_per_node: int) -> None:
    """``--torchrun-args`` may not set what ``distkit run`` sets from its own options: torchrun
    takes the last of two, so ``-n 2 --torchrun-args='--nproc_per_node 3'`` started 3."""
    for arg in launcher_args:
        option = arg.split("=", 1)[0]
        own = _OWN_TORCHRUN_OPTIONS.get(option)
        if own is not None:
            raise ConfigurationError(
                f"--torchrun-args sets {option}, which distkit run sets itself (-n "
                f"{nproc_per_node} gives --nproc_per_node {nproc_per_node}): use distkit run's "
                f"{own} instead, and keep --torchrun-args for the other torchrun options "
                "(--max-restarts, --rdzv-backend, ...)"
            )
