"""Asking SLURM to requeue the job this process runs in (``scontrol requeue``).

A job submitted with ``sbatch --requeue`` (or with the cluster's ``JobRequeue=1``) can be put
back in the queue by its own script: ``scontrol requeue <job id>`` ends this run of it and
starts it again later, under the same job id, where ``resume="auto"`` continues from the
preemption checkpoint. For a job array task the id is ``<array job id>_<task id>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

#: how long ``scontrol`` may take before the requeue counts as failed (seconds)
TIMEOUT_S = 30.0


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` takes for the job this process runs in (None: not in a
    SLURM job)."""
    env = os.environ if env is None else env
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def requeue(env: Mapping[str, str] | None = None) -> str:
    """Ask SLURM to requeue this job; returns one line saying what happened (never raises:
    the checkpoint is saved either way, and the job's exit status still says preempted)."""
    job = slurm_job_id(env)
    if job is None:
        return (
            "not requeued: not in a SLURM job (no SLURM_JOB_ID); restart the job yourself, or "
            "let your scheduler restart it on the exit status"
        )
    scontrol = shutil.which("scontrol", path=(os.environ if env is None else env).get("PATH"))
    if scontrol is None:
        return f"not requeued: SLURM job {job}, but no scontrol on PATH"
    command = [scontrol, "requeue", job]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not requeued: `{' '.join(command)}` failed ({exc})"
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        why = detail[-1] if detail else f"exit status {done.returncode}"
        return (
            f"not requeued: `scontrol requeue {job}` said: {why} (was the job submitted with "
            "sbatch --requeue?)"
        )
    return f"requeued SLURM job {job} (scontrol requeue {job})"
