"""What the launcher told this process, read once into a frozen dataclass.

Launchers announce themselves through environment variables (and, for the legacy
``torch.distributed.launch``, a ``--local_rank`` argument). Nothing here changes the environment.

Which launcher wins when several left variables: horovodrun (it may run on top of mpirun),
then torchrun (it may run inside a SLURM step: ``srun torchrun ...``, or in a Kubeflow pod),
then a replica of a Kubeflow PyTorchJob run as one ``python`` per pod, then mpirun / mpiexec
(Open MPI, MPICH, PMIx; inside SLURM too), then a SLURM step (``srun python ...``). A
``salloc`` shell (no ``SLURM_PROCID``) is a plain process; an sbatch script's own process
has ``SLURM_PROCID=0`` and looks like rank 0 of the step (see ``_torch_group._wait_for_tasks``).

Kubernetes: every pod has ``KUBERNETES_SERVICE_HOST``. The Kubeflow training operator gives a
PyTorchJob's pods (kubeflow/training-operator v1, ``pkg/controller.v1/pytorch``: envvar.go,
master.go, elastic.go) ``MASTER_ADDR=<job>-master-0``, ``MASTER_PORT``, ``RANK`` (the pod's
index: master 0, worker i -> i + 1) and ``WORLD_SIZE``; from v1.7 also torchrun's arguments as
``PET_*`` (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT``; with an elastic policy ``PET_RDZV_ENDPOINT``, ``PET_RDZV_BACKEND`` and no
``RANK``/``WORLD_SIZE`` unless the job has a master), and since v1.7 ``WORLD_SIZE`` counts
processes: pods x ``nprocPerNode`` (when that is a number). Trainer v2's TrainJob gives only the
``PET_*`` variables: its pods must run torchrun. So a pod's ``WORLD_SIZE`` is the number of
pods only when each pod runs one process; :meth:`LaunchEnv.detect` refuses the cases where a
plain ``python`` would join a world that cannot form or train alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from distkit.errors import ConfigurationError
from distkit.launch._hostlist import expand_hostlist

Launcher = Literal[
    "torchrun", "torch.distributed.launch", "horovodrun", "mpirun", "srun", "kubeflow", "none"
]
#: the container orchestrator whose pod this process runs in: ``"kubeflow"`` for a Kubeflow
#: training job's pod (PyTorchJob, TrainJob), ``"kubernetes"`` for any other pod
Pod = Literal["kubeflow", "kubernetes"]
#: the first port of the range distkit derives a rendezvous port from (srun, mpirun)
DERIVED_PORT_BASE = 20000
#: how many ports that range has: it ends below Linux's default ephemeral range (32768-60999),
#: where the kernel picks the local port of every outgoing connection and of every listener
#: bound to port 0 (gloo's among them): a derived port in there can be taken by any of those
#: on the first node, and rank 0's store then fails with EADDRINUSE
DERIVED_PORT_SPAN = 12768
#: the first port of Linux's default ephemeral range (net.ipv4.ip_local_port_range)
LINUX_EPHEMERAL_START = 32768

_LOCAL_RANK_ARG = re.compile(r"^--local[_-]rank(?:=(\d+))?$")
#: what the Kubeflow training operator sets in a training job's pods, for torchrun (v1.7+, v2)
_KUBEFLOW_VARS = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
#: the torchrun command a Kubeflow pod runs: torchrun reads its arguments from PET_* variables
_TORCHRUN_IN_POD = (
    "`torchrun train.py` as the container's command (no launcher arguments: torchrun reads them "
    "from the PET_* variables)"
)


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
        pod: the pod this process runs in, whatever launched it: ``"kubeflow"`` (a Kubeflow
            training job's), ``"kubernetes"`` (another pod), or None.
    """

    launcher: Launcher = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    elastic: bool = False
    pod: Pod | None = None

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
        """Whether srun, mpirun or the Kubeflow training operator (one process per pod) started
        this process: torch.distributed then meets at :attr:`master_addr`:`master_port` with a
        store that rank 0 hosts (no agent)."""
        return self.launcher in ("srun", "mpirun", "kubeflow")

    @classmethod
    def detect(
        cls, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
    ) -> LaunchEnv:
        """Read the launcher's announcement from ``environ`` and ``argv`` (default: ours)."""
        env = os.environ if environ is None else environ
        args = sys.argv if argv is None else argv
        found = cls._detect_launcher(env, args)
        pod = _pod(env)
        if pod == "kubeflow" and found.launcher == "none":
            _refuse_a_lone_python_in_a_torchrun_job(env)
        return found if pod is None else dataclasses.replace(found, pod=pod)

    @classmethod
    def _detect_launcher(cls, env: Mapping[str, str], args: Sequence[str]) -> LaunchEnv:
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
            if _is_kubeflow_replica(env, legacy_local_rank):
                _refuse_a_world_counted_for_torchrun(env)
                found = cls(
                    launcher="kubeflow",
                    rank=_int(env, "RANK", 0),
                    world_size=_int(env, "WORLD_SIZE", 1),
                    master_addr=env["MASTER_ADDR"],
                    master_port=_int(env, "MASTER_PORT", 0),
                )
                return found._in_range("RANK", "WORLD_SIZE")
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
        elif self.launcher == "kubeflow":
            cause = (
                "the Kubeflow training operator sets both for each pod (RANK: master 0, worker "
                "i -> i + 1): do not set them in the pod template's env"
            )
        else:
            cause = (
                f"{self.launcher} sets both for each process; a value set by hand or left over "
                "in the environment is the likely cause: unset it, or start the processes with "
                f"{self.launcher}"
            )
        raise ConfigurationError(f"{problem}; {cause}")


def _pod(env: Mapping[str, str]) -> Pod | None:
    """The pod this process runs in: Kubernetes sets ``KUBERNETES_SERVICE_HOST`` in every
    container; the Kubeflow training operator adds ``PET_*`` (v1.7+, v2) or, before v1.7,
    ``MASTER_ADDR=<job>-master-0`` (the master replica's pod and service)."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    if any(key in env for key in _KUBEFLOW_VARS) or env.get("MASTER_ADDR", "").endswith(
        "-master-0"
    ):
        return "kubeflow"
    return "kubernetes"


def _is_kubeflow_replica(env: Mapping[str, str], legacy_local_rank: int | None) -> bool:
    """A PyTorchJob replica's own process (``python train.py`` as the container's command):
    the operator's variables, no launcher of torch's in between (torchrun sets
    ``TORCHELASTIC_RUN_ID`` and ``LOCAL_RANK``, the legacy launcher ``--local_rank``)."""
    return (
        _pod(env) == "kubeflow"
        and "TORCHELASTIC_RUN_ID" not in env
        and "LOCAL_RANK" not in env
        and legacy_local_rank is None
        and bool(env.get("MASTER_ADDR"))
        and bool(env.get("MASTER_PORT"))
    )


def _refuse_a_world_counted_for_torchrun(env: Mapping[str, str]) -> None:
    """A replica run as one process, whose ``WORLD_SIZE`` counts pods x ``nprocPerNode``.

    Since v1.7 the operator sets ``WORLD_SIZE`` = replicas x ``nprocPerNode`` (when that is a
    number, else replicas) and ``RANK`` = the pod's index, for torchrun, which replaces both
    in the processes it starts. One process per pod would wait at the rendezvous for ranks
    that never come.
    """
    nproc = env.get("PET_NPROC_PER_NODE", "")
    if not (nproc.isdigit() and int(nproc) > 1):
        return
    pods = env.get("PET_NNODES") or str(_int(env, "WORLD_SIZE", 1) // int(nproc))
    raise ConfigurationError(
        f"WORLD_SIZE={env.get('WORLD_SIZE')} counts processes (PET_NNODES={pods} pods x "
        f"PET_NPROC_PER_NODE={nproc}), as the Kubeflow training operator sets it for torchrun, "
        f"and RANK={env.get('RANK')} is this pod's index; but this process was started without "
        f"torchrun, so the job has one process per pod and its group cannot form. Run "
        f"{_TORCHRUN_IN_POD}, or set nprocPerNode to 1 in the PyTorchJob to run one process "
        "per pod"
    )


def _refuse_a_lone_python_in_a_torchrun_job(env: Mapping[str, str]) -> None:
    """A pod that the operator set up for torchrun only (a TrainJob, or a PyTorchJob with an
    elastic policy and no master: ``PET_*``, no ``RANK``/``WORLD_SIZE``) running ``python``:
    each pod would train alone, a silently wrong result, unless the job is one process."""
    nodes = env.get("PET_NNODES", "1")
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    if nodes == "1" and not (nproc.isdigit() and int(nproc) > 1):
        return
    raise ConfigurationError(
        f"this pod is one of a Kubeflow training job's PET_NNODES={nodes} nodes "
        f"(PET_NPROC_PER_NODE={nproc}), whose variables are torchrun's arguments (PET_*): there "
        "is no RANK or WORLD_SIZE, so a process started without torchrun would train alone. "
        f"Run {_TORCHRUN_IN_POD}"
    )


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
