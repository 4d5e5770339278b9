"""scripts/gpu_check.sh, the GPU checklist in one command, on this (CPU) machine.

The GPU steps themselves run only on a GPU machine (docs/gpu.md); here the script's own
plumbing runs for real: steps under their time limits, the summary, the skip list, the suite
step's pytest through the script's PYTHON.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.signals import ctrl_c_delivered, ctrl_c_ignored


def _run(
    out: Path, budget: int, *, sigint_ignored: bool = False, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), str(budget)],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1",
            "GPU_CHECK_DEEPSPEED": str(out / "no-deepspeed"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=240,
        # the script cuts a step off with SIGINT; it must reach pytest either way
        **(ctrl_c_ignored() if sigint_ignored else ctrl_c_delivered()),
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


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["plain", "started-sigint-ignored"])
def test_gpu_check_cuts_a_step_off_at_its_share_of_the_budget(tmp_path, sigint_ignored):
    """A suite that outlasts its share is stopped with SIGINT, so pytest still prints its
    summary line, and the script goes on (rc 124 from timeout). Also when the script itself
    was started with SIGINT ignored (nohup, a background job): were SIG_IGN passed on to
    pytest, the SIGINT would be lost and SIGKILL would end it without a summary."""
    slow = tmp_path / "test_slow.py"
    slow.write_text("import time\n\ndef test_slow():\n    time.sleep(60)\n")
    proc = _run(
        tmp_path / "logs",
        10,
        GPU_CHECK_SKIP="smoke apex examples focus bench",
        SUITE_TESTS=str(slow),
        SUITE_WORKERS="1",
        sigint_ignored=sigint_ignored,
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


def test_gpu_check_focus_step_names_every_cuda_test_file_and_only_files_that_exist():
    """A CUDA-only test file (``test_cuda_*.py``) left out of the focus step would run on a
    lent GPU only if the suite reached it in its share: so each must be named there; and a
    renamed file must not drop out of the step unnoticed (pytest would fail the whole step
    on a missing path)."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    match = re.search(r'^FOCUS_DEFAULT="([^"]+)"', script, flags=re.MULTILINE)
    assert match is not None, "scripts/gpu_check.sh sets FOCUS_DEFAULT"
    named = match[1].split()
    assert [path for path in named if not (ROOT / path).exists()] == []
    covered = {path for path in named if path.endswith(".py")}
    folders = [path for path in named if (ROOT / path).is_dir()]
    cuda_files = {
        path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_cuda_*.py")
    }
    missing = {
        path for path in cuda_files
        if path not in covered and not any(path.startswith(f + "/") for f in folders)
    }  # fmt: skip
    assert cuda_files and missing == set()


def _gpu_wheels():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_wheels_installs_only_what_the_machine_lacks_or_has_older():
    """The GPU machine has no index: DeepSpeed's requirements come as wheels, and one the
    machine has at the same or a newer version stays the machine's (its numpy, its torch's
    typing-extensions), so nothing it was built against is replaced."""
    wheels = [
        "deepspeed-0.19.8-py3-none-any.whl",
        "typing_extensions-4.16.0-py3-none-any.whl",
        "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "py_cpuinfo-9.0.0-py3-none-any.whl",
        "tqdm-4.70.1-py3-none-any.whl",
        "README.txt",
    ]
    installed = {"typing-extensions": "4.16.0", "py-cpuinfo": "8.0.0", "tqdm": "4.71.0rc1",
                 "torch": "2.11.0+cu130"}  # fmt: skip
    take, leave = _gpu_wheels().wanted(wheels, installed)
    assert take == [wheels[0], wheels[2], wheels[3]]
    assert leave == [
        "typing-extensions: the machine's 4.16.0 (brought 4.16.0)",
        "tqdm: the machine's 4.71.0rc1 (brought 4.70.1)",
    ]


def test_gpu_check_says_when_it_has_no_deepspeed_to_install(tmp_path):
    proc = _run(
        tmp_path / "logs",
        60,
        GPU_CHECK_SKIP="smoke apex examples focus suite bench",
        GPU_CHECK_DEEPSPEED=str(tmp_path / "none"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "logs" / "summary.txt").read_text()
    assert f"deepspeed skipped: no {tmp_path / 'none'}/" in summary, summary


def test_gpu_scripts_parse():
    """gpu_prep.sh needs the package index (not here in the tests): its syntax, at least."""
    for script in ("gpu_check.sh", "gpu_prep.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)],
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, (script, proc.stderr)
