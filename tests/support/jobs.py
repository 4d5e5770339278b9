"""Running a job (a launcher and its ranks) from a test, with every process's stacks on a hang.

``subprocess.run(cmd, timeout=...)`` kills only the process it started: torchrun starts each
rank in a session of its own, so the ranks of a hung job outlive the test, and what the job
printed is lost with the pipe. :func:`run_job` writes the job's output to files, and on a
timeout sends SIGABRT to the whole process tree first: with ``PYTHONFAULTHANDLER`` set, every
Python process (launcher, ranks, DataLoader workers) prints all its threads' stacks before it
dies. The test then fails with that output, which names where each process was stuck.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.paths import ROOT

#: how long the processes of a timed-out job get to print their stacks before SIGKILL
DUMP_GRACE_S = 5.0


class JobTimeout(AssertionError):
    """A job ran past its timeout; the message holds its output and every process's stacks."""


def run_job(
    cmd: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to its end (any exit status) and return its output, as ``subprocess.run``
    with ``capture_output=True, text=True`` does; raise :class:`JobTimeout` after
    ``timeout`` seconds, with the stacks of every process of the job."""
    environment = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, text=True, env=environment, cwd=cwd
        )
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _abort_tree(proc)
            raise JobTimeout(
                f"{' '.join(map(str, cmd))} ran past its {timeout:.0f} s; every process was "
                "sent SIGABRT (each Python process prints its threads' stacks)\n"
                f"--- stdout (end)\n{_tail(out)}\n--- stderr (end)\n{_tail(err)}"
            ) from None
        return subprocess.CompletedProcess(list(cmd), returncode, _read(out), _read(err))


def run_example(cmd: list[str], cwd: Path, timeout: float = 150) -> str:
    """The output of an example run as a job (its ranks' ``[N]<stdout>:`` prefixes dropped);
    it must exit 0. On a hang, a failure with every process's stacks (:func:`run_job`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)  # the examples limit threads themselves under horovodrun
    proc = run_job(cmd, env=env, timeout=timeout, cwd=cwd)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return re.sub(r"^\[\d+\]<std(?:out|err)>:", "", output, flags=re.MULTILINE)


def _read(file: tempfile._TemporaryFileWrapper[str]) -> str:
    file.seek(0)
    return file.read()


def _tail(file: tempfile._TemporaryFileWrapper[str], chars: int = 20_000) -> str:
    return _read(file)[-chars:]


def _abort_tree(proc: subprocess.Popen[str]) -> None:
    """SIGABRT to ``proc`` and all its descendants (sessions of their own included), a grace
    for the stack dumps, then SIGKILL to whatever is left."""
    tree = [proc.pid, *descendants(proc.pid)]
    for pid in tree:
        _signal(pid, signal.SIGABRT)
    deadline = time.monotonic() + DUMP_GRACE_S
    while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
        proc.poll()  # reaps the direct child
        time.sleep(0.1)
    for pid in [*tree, *descendants(proc.pid)]:
        _signal(pid, signal.SIGKILL)
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
