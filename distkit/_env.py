"""What the launcher told this process, read once into a frozen dataclass.

Launchers announce themselves through environment variables (and, for the legacy
``torch.distributed.launch``, a ``--local_rank`` argument). Nothing here changes the environment.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Launcher = Literal["torchrun", "torch.distributed.launch", "horovodrun", "mpirun", "none"]

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
    """

    launcher: Launcher = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

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

    @classmethod
    def detect(
        cls, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
    ) -> LaunchEnv:
        """Read the launcher's announcement from ``environ`` and ``argv`` (default: ours)."""
        env = os.environ if environ is None else environ
        args = sys.argv if argv is None else argv
        if "HOROVOD_RANK" in env or "HOROVOD_SIZE" in env:
            return cls(
                launcher="horovodrun",
                rank=_int(env, "HOROVOD_RANK", 0),
                local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
                world_size=_int(env, "HOROVOD_SIZE", 1),
            )
        if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
            return cls(
                launcher="mpirun",
                rank=_int(env, "OMPI_COMM_WORLD_RANK", _int(env, "PMI_RANK", 0)),
                local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", _int(env, "MPI_LOCALRANKID", 0)),
                world_size=_int(env, "OMPI_COMM_WORLD_SIZE", _int(env, "PMI_SIZE", 1)),
            )
        legacy_local_rank = _local_rank_from_argv(args)
        if "WORLD_SIZE" in env and "RANK" in env:
            torchrun = "TORCHELASTIC_RUN_ID" in env and legacy_local_rank is None
            local_rank = _int(env, "LOCAL_RANK", legacy_local_rank or 0)
            return cls(
                launcher="torchrun" if torchrun else "torch.distributed.launch",
                rank=_int(env, "RANK", 0),
                local_rank=local_rank,
                world_size=_int(env, "WORLD_SIZE", 1),
                master_addr=env.get("MASTER_ADDR"),
                master_port=_int(env, "MASTER_PORT", 0) or None,
            )
        return cls()


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
