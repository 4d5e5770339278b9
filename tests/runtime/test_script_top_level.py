"""A user's script at its top level, under torchrun (issue 44, item 6): a flat script (no
``main()`` to indent under ``with rt:``) gets the block's fail-fast guard from
``rt.guard_script()``; a refusal from the Runtime's start (strategy='apex' without CUDA) that
the script does not catch prints one line, not a traceback from every rank. Real torchrun
jobs on gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(300)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

FLAT = """
import sys, time, torch, distkit
from torch import nn
rt = distkit.Runtime("ddp", seed=0, fault_timeout=5).guard_script()
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = rt.setup(model, opt)
data = torch.utils.data.TensorDataset(torch.randn(400, 4), torch.randn(400, 2))
for step, (x, y) in enumerate(rt.loader(data, batch_size=2)):
    if step == 3 and rt.rank == int(sys.argv[1]):
        raise ValueError("bad sample on purpose")
    if step == 3 and sys.argv[2] == "slow":
        open(f"ready{rt.rank}", "w").close()
        time.sleep(60)
    rt.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
rt.print("finished; closed at the end:", rt.closed)
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _torchrun(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.py").write_text(script)
    return subprocess.run([*TORCHRUN, "job.py", *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=240)  # fmt: skip


def test_a_flat_script_that_ends_closes_its_runtime_and_exits_0(tmp_path):
    proc = _torchrun(tmp_path, FLAT, "-1", "fast")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished; closed at the end: False" in proc.stdout


def test_a_rank_failing_in_a_flat_script_stops_the_other_in_seconds(tmp_path):
    start = time.monotonic()
    proc = _torchrun(tmp_path, FLAT, "1", "fast")
    took = time.monotonic() - start
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count("ValueError: bad sample on purpose") >= 1
    assert "PeerFailureError: rank 0 stopped because rank 1 failed" in out
    assert out.count("Traceback (most recent call last)") <= 3  # rank 1, rank 0, torchrun
    assert took < 120  # without the guard rank 0 waits out gloo's 30-minute timeout


def test_ctrl_c_in_a_flat_script_stops_every_rank_with_130(tmp_path):
    (tmp_path / "job.py").write_text(FLAT)
    proc = subprocess.Popen([*TORCHRUN, "job.py", "-1", "slow"], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.count("interrupted (Ctrl-C)") == 1, err[-3000:]  # one line for the job
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_apex_without_cuda_in_a_users_script_says_one_line(tmp_path):
    """Before: each rank printed ApexNeedsCudaError's traceback (72 lines with torchrun's
    summary). Now one line from distkit, naming the script's line; torchrun then adds its
    own summary of the exit codes, which no worker can silence (``distkit run`` checks before
    it starts any rank and prints only the line)."""
    proc = _torchrun(tmp_path, "import distkit\n\nrt = distkit.Runtime('apex')\n")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    (line,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert line.startswith("error: ApexNeedsCudaError: strategy='apex' needs CUDA")
    assert line.endswith("(job.py, line 3)")
    assert out.count("ApexNeedsCudaError") == 1  # no rank's traceback
    alone = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert alone.returncode == 1 and alone.stderr.strip() == line


def test_a_caught_refusal_is_the_scripts_to_handle(tmp_path):
    script = (
        "import distkit\ntry:\n    distkit.Runtime('apex')\nexcept distkit.DistkitError:\n"
        "    print('handled')\nraise ValueError('later')\n"
    )
    (tmp_path / "job.py").write_text(script)
    proc = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "handled" in proc.stdout
    assert "Traceback" in proc.stderr and "ValueError: later" in proc.stderr
    assert "error: " not in proc.stderr
