"""The same script under every launcher: plain python, torchrun, torch.distributed.launch.

These start real launcher subprocesses (slow-ish: ~10 s each), so there are few of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.exactness import TOL
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import sys, torch
from torch import nn
import distkit
from tests.support.exactness import DTYPE
from tests.support.workloads import make_dataset, make_mlp

# torch.distributed.launch adds --local-rank=N, as a user's argparse would accept
args = [a for a in sys.argv[1:] if not a.startswith("--local")]
strategy, batch_size, out = args[0], int(args[1]), args[2]
trainer = distkit.Trainer(strategy, batch_size=batch_size, max_epochs=2, seed=5)
model = make_mlp(dtype=DTYPE)  # float64: the launches are compared at 1e-9
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
trainer.fit(model, opt, make_dataset(64, dtype=DTYPE), loss_fn=nn.functional.cross_entropy)
print(f"STRATEGY={trainer.strategy.name} RANK={trainer.rank} WORLD={trainer.world_size}")
if trainer.is_main:
    torch.save(model.state_dict(), out)
"""


def _run(tmp_path: Path, launcher: list[str], *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [*launcher, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=200,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
LEGACY = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2"]


def test_launchers_same_parameters_under_python_torchrun_and_legacy_launch(tmp_path):
    single = _run(tmp_path, [sys.executable], "ddp", "8", "single.pt")
    assert "STRATEGY=ddp RANK=0 WORLD=1" in single.stdout
    torchrun = _run(tmp_path, TORCHRUN, "auto", "4", "torchrun.pt")
    assert "STRATEGY=ddp RANK=1 WORLD=2" in torchrun.stdout  # auto picked ddp
    legacy = _run(tmp_path, LEGACY, "ddp", "4", "legacy.pt")
    assert "STRATEGY=ddp RANK=1 WORLD=2" in legacy.stdout
    states = {
        name: torch.load(tmp_path / f"{name}.pt") for name in ("single", "torchrun", "legacy")
    }
    assert max_abs_diff(states["single"], states["torchrun"]) <= TOL
    assert max_abs_diff(states["torchrun"], states["legacy"]) <= TOL
    # progress and epoch summaries come from rank 0 only
    assert torchrun.stdout.count("epoch 2/2 train_loss=") == 1, torchrun.stdout


def test_launchers_auto_is_dp_in_a_plain_process(tmp_path):
    proc = _run(tmp_path, [sys.executable], "auto", "8", "auto.pt")
    assert "STRATEGY=dp RANK=0 WORLD=1" in proc.stdout
