"""Faults on real launchers: a killed worker resumes exactly, a raising rank stops everyone fast,
and non-finite losses follow the policy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.errors import NonFiniteLossError
from tests.support.exactness import TOL
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(300)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _job(launcher: list[str], out: Path, *args: str, timeout: float = 240) -> tuple:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    script = str(ROOT / "tests" / "support" / "job_scripts" / "fault_job.py")
    proc = subprocess.run(
        [*launcher, script, args[0], str(out), *args[1:]],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    return proc, time.monotonic() - start


def test_faults_killed_worker_restarts_and_resumes_exactly(tmp_path):
    clean, _ = _job(TORCHRUN, tmp_path / "clean", "ddp")
    assert clean.returncode == 0, clean.stderr[-3000:]
    restart = [*TORCHRUN[:3], "--max-restarts", "1", *TORCHRUN[3:]]
    killed, _ = _job(restart, tmp_path / "killed", "ddp", "--kill-at", "5")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert (tmp_path / "killed" / "killed").exists(), "the worker was never killed"
    reference = torch.load(tmp_path / "clean" / "final.pt")
    recovered = torch.load(tmp_path / "killed" / "final.pt")
    assert max_abs_diff(reference, recovered) <= TOL  # dropout on: RNG restored per rank


def _assert_stopped_fast(proc: subprocess.CompletedProcess, seconds: float) -> None:
    assert proc.returncode != 0
    assert seconds < 45, f"took {seconds:.0f}s to stop"
    output = proc.stdout + proc.stderr
    # horovodrun prefixes "[1]<stderr>:", torchrun "[rank1]: "
    prefix = r"^(?:\[\d+\]<std(?:out|err)>:|\[rank\d+\]: )"
    lines = [re.sub(prefix, "", line) for line in output.splitlines()]
    tracebacks = [line for line in lines if line.startswith("ValueError: boom")]
    assert len(tracebacks) == 1, output[-4000:]  # the failing rank's error, shown once
    assert "rank 0 done" not in output
    assert (
        sum("Traceback (most recent call last)" in line for line in lines if "distkit" in line) <= 1
    )


def test_faults_raising_rank_stops_every_ddp_rank_fast(tmp_path):
    proc, seconds = _job(TORCHRUN, tmp_path, "ddp", "--raise-at", "3", timeout=120)
    _assert_stopped_fast(proc, seconds)


@needs("horovod")
def test_faults_raising_rank_stops_every_horovod_rank_fast(tmp_path):
    launcher = [horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]
    proc, seconds = _job(launcher, tmp_path, "horovod", "--raise-at", "3", timeout=120)
    _assert_stopped_fast(proc, seconds)


# ---------------------------------------------------------------- non-finite losses
def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 3, generator=generator), torch.randn(32, 1))


def _nan_on(rank: int, at_step: int, policy: str) -> dict:
    trainer = distkit.Trainer("ddp", batch_size=4, nonfinite=policy, progress=False)
    model = nn.Linear(3, 1)
    calls = {"n": 0}

    def step_fn(m, batch):
        calls["n"] += 1
        loss = nn.functional.mse_loss(m(batch[0]), batch[1])
        if trainer.rank == rank and calls["n"] == at_step:
            return loss * float("nan")
        return loss

    try:
        result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                             step_fn=step_fn)  # fmt: skip
        out = {"history": result.history, "weight": model.weight.detach().clone()}
    except NonFiniteLossError as exc:
        out = {"error": str(exc)}
    trainer.close()
    return out


def test_faults_nonfinite_skip_skips_the_same_step_on_every_rank(run_on_ranks):
    results = run_on_ranks(_nan_on, 1, 2, "skip", world_size=2)
    for result in results:
        assert result["history"][0]["skipped_steps"] == 1
        assert result["history"][0]["train_loss"] == result["history"][0]["train_loss"]  # not NaN
        assert torch.isfinite(result["weight"]).all()
    assert torch.equal(results[0]["weight"], results[1]["weight"])


def test_faults_nonfinite_raise_names_step_and_rank():
    trainer = distkit.Trainer("dp", batch_size=4, progress=False)
    model = nn.Linear(3, 1)

    def step_fn(m, batch):
        return nn.functional.mse_loss(m(batch[0]), batch[1]) * float("inf")

    with pytest.raises(NonFiniteLossError, match=r"rank 0 in epoch 0, step 1.*nonfinite='skip'"):
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), step_fn=step_fn)


def _nan_raise(rank: int, at_call: int, folder: str | None, settings: dict) -> dict:
    trainer = distkit.Trainer("ddp", batch_size=2, progress=False, checkpoint_dir=folder,
                              **settings)  # fmt: skip
    model = nn.Linear(3, 1)
    calls = {"n": 0}

    def step_fn(m, batch):
        calls["n"] += 1
        loss = nn.functional.mse_loss(m(batch[0]), batch[1])
        return loss * float("nan") if trainer.rank == rank and calls["n"] == at_call else loss

    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), step_fn=step_fn)
        return {"error": None}
    except NonFiniteLossError as exc:
        return {"error": str(exc), "step": trainer.global_step}
    finally:
        trainer.close()


def test_faults_nonfinite_raise_is_found_at_the_next_log_point_on_every_rank(run_on_ranks):
    """No host sync per step: rank 1's NaN at step 3 is read at the log point of step 5;
    both ranks raise the same error there (none hangs), naming rank, step and the delay."""
    results = run_on_ranks(_nan_raise, 1, 3, None, {"log_every_n_steps": 5}, world_size=2)
    assert results[0] == results[1], results
    assert results[0]["step"] == 5
    assert "(nan) on rank 1 in epoch 0, step 3 (found 2 step(s) later" in results[0]["error"]
    assert "log_every_n_steps=5" in results[0]["error"]


def test_faults_nonfinite_raise_writes_no_checkpoint_after_the_bad_step(run_on_ranks, tmp_path):
    """A checkpoint point reads the losses first: the NaN of step 2 stops fit at step 3's
    checkpoint point, before step-000000003.pt (the first checkpoint) is written."""
    results = run_on_ranks(_nan_raise, 0, 2, str(tmp_path), {"checkpoint_every": 3}, world_size=2)
    assert results[0]["step"] == 3 and "on rank 0 in epoch 0, step 2" in results[0]["error"]
    assert not any(tmp_path.rglob("*.pt")), sorted(tmp_path.rglob("*"))


def test_faults_nonfinite_raise_is_read_before_fit_stops_at_max_steps(run_on_ranks):
    """A fit that ends early (max_steps) between log points still reads its last steps."""
    results = run_on_ranks(_nan_raise, 1, 4, None, {"max_steps": 4}, world_size=2)
    assert results[0] == results[1]
    assert "on rank 1 in epoch 0, step 4." in results[0]["error"]


def test_faults_fp16_scaler_skips_are_reported():
    trainer = distkit.Trainer("dp", batch_size=4, precision="fp16", progress=False)
    trainer.strategy.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    model = nn.Linear(3, 1)
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                         loss_fn=nn.functional.mse_loss)  # fmt: skip
    assert result.history[0]["skipped_steps"] > 0  # overflowing steps were skipped and counted
