"""Where the MPI launchers are: Open MPI's ``mpirun``, MPICH's ``mpiexec`` (nox installs both)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def mpirun_path() -> str | None:
    """Open MPI's ``mpirun`` next to this Python, else on PATH."""
    found = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    return found


def mpich_bin() -> str | None:
    """MPICH's bin folder (nox installs it beside Open MPI and names it here)."""
    folder = os.environ.get("DISTKIT_TEST_MPICH")
    return folder if folder and Path(folder, "mpiexec").exists() else None
