"""scripts/gpu_check.sh, the GPU checklist in one command, on this (CPU) machine.

The GPU steps themselves run only on a GPU machine (docs/gpu.md); here the script's own
plumbing runs for real: steps under their time limits, the summary, the skip list, the suite
step's pytest through the script's PYTHON.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT


def _run(out: Path, budget: int, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), str(budget)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_gpu_check_runs_its_steps_and_writes_one_summary_line_each(tmp_path):
    proc = _run(
        tmp_path / "logs",
        120,
        GPU_CHECK_SKIP="smoke apex examples focus bench",
        SUITE_TESTS="tests/test_layers.py",
        SUITE_WORKERS="1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "logs" / "summary.txt").read_text().splitlines()
    assert summary[:1] == ["smoke skipped (GPU_CHECK_SKIP)"]
    suite = [line for line in summary if line.startswith("suite ")]
    assert len(suite) == 1 and suite[0].startswith("suite rc=0 "), summary
    assert "bench skipped (GPU_CHECK_SKIP)" in summary and summary[-1].startswith("done at ")
    log = (tmp_path / "logs" / "suite.log").read_text()
    assert " passed" in log and (tmp_path / "logs" / "suite.xml").is_file()


def test_gpu_check_cuts_a_step_off_at_its_share_of_the_budget(tmp_path):
    """A suite that outlasts its share is stopped with SIGINT, so pytest still prints its
    summary line, and the script goes on (rc 124 from timeout)."""
    slow = tmp_path / "test_slow.py"
    slow.write_text("import time\n\ndef test_slow():\n    time.sleep(60)\n")
    proc = _run(
        tmp_path / "logs",
        10,
        GPU_CHECK_SKIP="smoke apex examples focus bench",
        SUITE_TESTS=str(slow),
        SUITE_WORKERS="1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "logs" / "summary.txt").read_text()
    assert "suite rc=124 " in summary, summary
    assert "KeyboardInterrupt" in (tmp_path / "logs" / "suite.log").read_text()


def test_gpu_check_focus_step_runs_its_tests_beside_the_suite(tmp_path):
    """The focus step (the in-process CUDA paths, whatever the suite reaches) is a pytest
    run of its own, with its own log, JUnit file and summary line."""
    proc = _run(
        tmp_path / "logs",
        120,
        GPU_CHECK_SKIP="smoke apex examples suite bench",
        FOCUS_TESTS="tests/test_layers.py",
        FOCUS_WORKERS="1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "logs" / "summary.txt").read_text().splitlines()
    focus = [line for line in summary if line.startswith("focus ")]
    assert len(focus) == 1 and focus[0].startswith("focus rc=0 "), summary
    assert " passed" in (tmp_path / "logs" / "focus.log").read_text()
    assert (tmp_path / "logs" / "focus.xml").is_file()
