"""Horovod started and stopped 20 times in one ``horovodrun -np 2`` job never aborts.

tests/support/job_scripts/horovod_reinit_job.py runs 20 cycles of two distkit Trainers (fit,
``close()``) and ``hvd.shutdown()``. With Horovod 0.28.1's rendezvous server as released, keys
of a finished ``hvd.init()`` stayed in the server, and such jobs aborted in gloo ("Connection
refused") in 2 of 5 runs here; ``python -m distkit.horovod_build`` patches the server (see
tests/test_horovod_build.py for the patch itself).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.exactness import TOL  # train_with_distkit's runs are float64
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff, train_with_distkit

pytestmark = [
    pytest.mark.timeout(300),
    needs("horovod"),
]

CYCLES = 20
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def cycles(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The job's output and each rank's record after its last finished cycle (the job runs once
    for the module)."""
    out = tmp_path_factory.mktemp("reinit")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in LAUNCHER_VARS:
        env.pop(key, None)
    cmd = [
        str(horovodrun_path()), "-np", "2", "-H", "localhost:2", "--gloo",
        sys.executable, "-m", "tests.support.job_scripts.horovod_reinit_job", str(out),
        "--cycles", str(CYCLES),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout or b""  # bytes even with text=True
        done = (output.decode() if isinstance(output, bytes) else output).count(" done")
        pytest.fail(f"the job hung after {done} of {CYCLES} cycles")
    ranks = [out / f"rank{rank}.pt" for rank in range(2)]
    records = [torch.load(path) for path in ranks if path.exists()]
    return proc, records


def test_horovod_restarted_20_times_in_one_job_never_aborts(cycles):
    proc, records = cycles
    output = proc.stdout + proc.stderr
    done = output.count(" done")
    assert proc.returncode == 0, f"aborted after {done} of {CYCLES} cycles:\n{output[-3000:]}"
    assert "gloo::" not in output, output[-3000:]
    assert [record["cycles"] for record in records] == [CYCLES, CYCLES]


def test_horovod_rendezvous_server_keeps_no_keys_of_a_finished_init(cycles):
    """The cause, checked directly: a finished init's scopes must be empty. The released
    server keeps keys more often than it aborts, though not in every run."""
    _, records = cycles
    assert len(records) == 2, "a rank finished no cycle (see the first test for the output)"
    stale = {
        f"rank {rank}, before cycle {cycle}": keys
        for rank, record in enumerate(records)
        for cycle, keys in enumerate(record["stale"])
        if keys
    }
    assert stale == {}, "python -m distkit.horovod_build --force rebuilds with the fix"


def test_every_restart_trains_like_one_process_with_the_whole_batch(cycles):
    _, records = cycles
    assert len(records) == 2, "a rank finished no cycle (see the first test for the output)"
    one = train_with_distkit("dp", 8, n=24, epochs=1)  # 2 ranks x 4 per step
    assert [record["identical"] for record in records] == [True, True]
    assert max_abs_diff(records[0]["state"], records[1]["state"]) == 0.0
    assert max_abs_diff(records[0]["state"], one["state"]) <= TOL
