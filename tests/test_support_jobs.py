"""The test helper that runs jobs: a hung job fails with every process's stacks, its whole
process tree (ranks in sessions of their own, as torchrun starts them) killed."""

from __future__ import annotations

import sys
import time

import pytest

from tests.support.jobs import JobTimeout, descendants, run_job

pytestmark = pytest.mark.timeout(60)

# a parent that starts a child in a session of its own (as torchrun starts its ranks), and
# both wait forever in functions named after what they are
_HUNG_JOB = """
import subprocess, sys, time
def parent_waits_forever():
    time.sleep(3600)
child = "import time\\ndef child_waits_forever():\\n    time.sleep(3600)\\nchild_waits_forever()"
subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
print("started", flush=True)
parent_waits_forever()
"""


def test_run_job_returns_the_output_and_status_like_subprocess_run():
    done = run_job([sys.executable, "-c", "import sys; print('out'); sys.exit('err')"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (1, "out\n", "err\n")


def test_a_hung_job_fails_with_every_process_stack_and_leaves_no_process(tmp_path):
    started = time.monotonic()
    with pytest.raises(JobTimeout) as failure:
        run_job([sys.executable, "-c", _HUNG_JOB], timeout=3, cwd=tmp_path)
    message = str(failure.value)
    assert "ran past its 3 s" in message and "started" in message
    # both stacks (faulthandler): the parent's, and the child's in its own session
    assert "parent_waits_forever" in message and "child_waits_forever" in message
    assert time.monotonic() - started < 20
    # and the child is gone: no process on the machine still runs it
    assert not [p for p in _all_pids() if "child_waits_forever" in _cmdline(p)]


def test_descendants_lists_the_tree_below_a_process():
    import subprocess

    sleeper = "import time; time.sleep(30)"
    code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(30)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(proc.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = descendants(proc.pid)
        assert descendants(child) == []
    finally:
        for pid in [*descendants(proc.pid), proc.pid]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait()


def _all_pids() -> list[int]:
    import os

    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""
