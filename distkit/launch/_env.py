"""What the launcher told this process, read once into a frozen dataclass.

Launchers announce themselves through environment variables (and, for the legacy
``torch.distributed.launch``, a ``--local_rank`` argument). Nothing here changes the environment.

Which launcher wins when several left variables: horovodrun (it may run on top of mpirun),
then torchrun (it may run inside a SLURM step: ``srun torchrun ...``), then mpirun / mpiexec
(Open MPI, MPICH, PMIx; inside SLURM too), then a SLURM step (``srun python ...``). A
``salloc`` shell (no ``SLURM_PROCID``) is a plain process; an sbatch script's own process
has ``SLURM_PROCID=0`` and looks like rank 0 of the step (see ``_torch_group._wait_for_tasks``).
"""

from __future__ import annotations

import os
import re
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from distkit.errors import ConfigurationError
from distkit.launch._hostlist import expand_hostlist

Launcher = Literal["torchrun", "torch.distributed.launch", "horovodrun", "mpirun", "srun", "none"]
#: the first port of the range distkit derives a rendezvous port from (srun, mpirun)
DERIVED_PORT_BASE = 20000
#: how many ports that range has
DERIVED_PORT_SPAN = 20000

_LOCAL_RANK_ARG = re.compile(r"^--local[_-]rank(?:=(\d+))?$")


@dataclass(frozen=True)
class LaunchEnv:
    """The process topology as announced by the launcher.

    Attributes:
        launcher: which launcher started this process (``"none"`` for a plain ``python``).
        rank: global rank announced by the launcher (0 when none).
        local_rank: rank on this node (0 when none).
        world_size: number of processes (1 when none).
        master_addr: rendezvous address for torch.distributed, if any.
        master_port: rendezvous port for torch.distributed, if any.
        elastic: the launcher may add and remove processes during the run (horovodrun
            ``--min-np/--max-np`` with a host discovery script).
    """

    launcher: Launcher = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    elastic: bool = False

    @property
    def is_multiprocess_launcher(self) -> bool:
        """Whether a launcher that starts one process per rank is in charge."""
        return self.launcher != "none"

    @property
    def is_torch_launcher(self) -> bool:
        """Whether torchrun or ``torch.distributed.launch`` started this process."""
        return self.launcher in ("torchrun", "torch.distributed.launch")

    @property
    def is_horovod_launcher(self) -> bool:
        """Whether horovodrun (or mpirun, which Horovod also runs under) started this process."""
        return self.launcher in ("horovodrun", "mpirun")

    @property
    def is_cluster_launcher(self) -> bool:
        """Whether srun or mpirun started this process: torch.distributed then meets at
        :attr:`master_addr`:`master_port` with a store that rank 0 hosts (no agent)."""
        return self.launcher in ("srun", "mpirun")

    @classmethod
    def detect(
        cls, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
    ) -> LaunchEnv:
        """Read the launcher's announcement from ``environ`` and ``argv`` (default: ours)."""
        env = os.environ if environ is None else environ
        args = sys.argv if argv is None else argv
        if "HOROVOD_RANK" in env or "HOROVOD_SIZE" in env:
            found = cls(
                launcher="horovodrun",
                rank=_int(env, "HOROVOD_RANK", 0),
                local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
                world_size=_int(env, "HOROVOD_SIZE", 1),
                elastic=env.get("HOROVOD_ELASTIC") == "1",
            )
            return found._in_range("HOROVOD_RANK", "HOROVOD_SIZE")
        legacy_local_rank = _local_rank_from_argv(args)
        if "WORLD_SIZE" in env and "RANK" in env:
            torchrun = "TORCHELASTIC_RUN_ID" in env and legacy_local_rank is None
            local_rank = _int(env, "LOCAL_RANK", legacy_local_rank or 0)
            found = cls(
                launcher="torchrun" if torchrun else "torch.distributed.launch",
                rank=_int(env, "RANK", 0),
                local_rank=local_rank,
                world_size=_int(env, "WORLD_SIZE", 1),
                master_addr=env.get("MASTER_ADDR"),
                master_port=_int(env, "MASTER_PORT", 0) or None,
            )
            return found._in_range("RANK", "WORLD_SIZE")
        slurm_step = "SLURM_PROCID" in env
        if "OMPI_COMM_WORLD_SIZE" in env or ("PMI_SIZE" in env and not slurm_step):
            found = cls(
                launcher="mpirun",
                rank=_int(env, "OMPI_COMM_WORLD_RANK", _int(env, "PMI_RANK", 0)),
                local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", _int(env, "MPI_LOCALRANKID", 0)),
                world_size=_int(env, "OMPI_COMM_WORLD_SIZE", _int(env, "PMI_SIZE", 1)),
                master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
                master_port=_int(env, "MASTER_PORT", 0) or _mpi_port(env),
            )
            return found._in_range(
                _first_set(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
                _first_set(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
            )
        if slurm_step:
            found = cls(
                launcher="srun",
                rank=_int(env, "SLURM_PROCID", 0),
                local_rank=_int(env, "SLURM_LOCALID", 0),
                world_size=_int(env, "SLURM_NTASKS", _int(env, "SLURM_NPROCS", 1)),
                master_addr=env.get("MASTER_ADDR") or _slurm_first_host(env),
                master_port=_int(env, "MASTER_PORT", 0) or _slurm_port(env),
            )
            return found._in_range("SLURM_PROCID", _first_set(env, "SLURM_NTASKS", "SLURM_NPROCS"))
        return cls()

    def _in_range(self, rank_key: str, size_key: str) -> LaunchEnv:
        """Itself, if its rank lies in 0..world_size-1: a rank outside would wait for a world
        that cannot form (until the 30-minute rendezvous time-out) or train alone."""
        if self.world_size >= 1 and 0 <= self.rank < self.world_size:
            return self
        size = f"{size_key}={self.world_size}" if size_key else "no world size set (so 1)"
        if self.world_size < 1:
            problem = f"{size} (with {rank_key}={self.rank}): the world size must be >= 1"
        else:
            problem = (
                f"{rank_key}={self.rank} with {size}: a rank must lie in 0..{self.world_size - 1}"
            )
        if self.launcher == "srun":
            cause = (
                "these are not one srun step's variables: start the tasks with `srun python "
                "train.py` (srun sets both for each task), and do not set or copy SLURM_PROCID "
                "or SLURM_NTASKS by hand"
            )
        else:
            cause = (
                f"{self.launcher} sets both for each process; a value set by hand or left over "
                "in the environment is the likely cause: unset it, or start the processes with "
                f"{self.launcher}"
            )
        raise ConfigurationError(f"{problem}; {cause}")


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {key}={value!r} is not an integer; the launcher that set it "
            "is misconfigured (unset it or launch with torchrun / horovodrun)"
        ) from None


def _first_set(env: Mapping[str, str], *keys: str) -> str:
    """The first of ``keys`` set in ``env`` (to name it in a message), else ``""``."""
    return next((key for key in keys if env.get(key)), "")


def _slurm_first_host(env: Mapping[str, str]) -> str:
    """The step's first node (rank 0 runs there under srun's block distribution)."""
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(key):
            try:
                return expand_hostlist(env[key])[0]
            except ValueError as exc:
                raise ValueError(f"environment variable {key}: {exc}") from None
    return "127.0.0.1"


def _slurm_port(env: Mapping[str, str]) -> int:
    """A port every task of the step derives alike: from the job and step ids."""
    job, step = _int(env, "SLURM_JOB_ID", 0), _int(env, "SLURM_STEP_ID", 0)
    return DERIVED_PORT_BASE + (job * 97 + step) % DERIVED_PORT_SPAN


def _mpi_port(env: Mapping[str, str]) -> int:
    """A port every rank of the MPI job derives alike on one node: from the job's name
    (PMIx namespace, Open MPI's job id), else the launcher's process (mpiexec's proxy)."""
    job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or str(os.getppid())
    return DERIVED_PORT_BASE + zlib.crc32(job.encode()) % DERIVED_PORT_SPAN


def _local_rank_from_argv(argv: Sequence[str]) -> int | None:
    """The legacy ``--local_rank N`` / ``--local-rank=N`` argument of torch.distributed.launch."""
    for i, arg in enumerate(argv):
        match = _LOCAL_RANK_ARG.match(arg)
        if not match:
            continue
        if match.group(1) is not None:
            return int(match.group(1))
        if i + 1 < len(argv) and argv[i + 1].isdigit():
            return int(argv[i + 1])
    return None
