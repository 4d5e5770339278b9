"""Start a contract run's ranks with ``horovodrun -np N -H localhost:N --gloo``.

The ranks are new Python processes: they import the strategy (and a ``rank_setup``) by name,
so they get this process's ``sys.path`` through ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from distkit.errors import MissingDependencyError

_HINT = (
    "Install Horovod (python -m distkit.horovod_build builds it against this torch), or run "
    "the promises with launcher='processes' for a strategy launched like torchrun"
)


def horovodrun_path() -> str | None:
    """The ``horovodrun`` beside this interpreter, else the one on PATH (None: neither)."""
    beside = Path(sys.executable).parent / "horovodrun"
    return str(beside) if beside.exists() else shutil.which("horovodrun")


def run_under_horovodrun(workdir: Path, world_size: int, timeout: float) -> str | None:
    """Run the plan in ``workdir`` on ``world_size`` Horovod ranks; what went wrong, if anything.

    Raises:
        MissingDependencyError: no ``horovodrun`` command.
    """
    launcher = horovodrun_path()
    if launcher is None:
        raise MissingDependencyError(
            f"launcher='horovodrun' needs the horovodrun command, found neither beside "
            f"{sys.executable} nor on PATH. {_HINT}"
        )
    paths = [p or os.getcwd() for p in sys.path]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    cmd = [
        launcher,
        "-np",
        str(world_size),
        "-H",
        f"localhost:{world_size}",
        "--gloo",
        sys.executable,
        "-m",
        "distkit.testing._worker",
        str(workdir),
    ]
    # a session of its own: on a timeout the ranks go with horovodrun, not only horovodrun
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return f"horovodrun did not finish within {timeout:g}s; its output ends:\n{output[-4000:]}"
    (workdir / "horovodrun.log").write_text(output)
    if proc.returncode != 0:
        return (
            f"horovodrun exited with status {proc.returncode}; its output ends:\n{output[-4000:]}"
        )
    return None
