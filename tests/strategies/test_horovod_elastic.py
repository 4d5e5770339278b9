"""Horovod elastic (``horovodrun --min-np/--max-np --host-discovery-script``) on one machine:
a host removed and a host added mid-run; the job goes on at the new size, from distkit's
last commit in memory, without a restart from disk (the script has no checkpoint folder).

The hosts are ``localhost`` and ``127.0.0.1``, which Horovod treats as two hosts; the test
edits the file the discovery script prints. Skipped where Horovod is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff

pytestmark = [
    pytest.mark.timeout(300),
    needs("horovod"),
]

EPOCHS = 4


class ElasticJob:
    def __init__(self, out: Path, hosts: list[str], np: int) -> None:
        self.out = out
        self.hosts_file = out / "hosts"
        self.set_hosts(hosts)
        discover = out / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        discover.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        script = [
            sys.executable,
            "-m",
            "tests.support.job_scripts.horovod_elastic_job",
            str(out),
            "0.25",
        ]
        cmd = [horovodrun_path(), "-np", str(np), "--min-np", "1", "--max-np", "2",
               "--host-discovery-script", str(discover), "--network-interface", "lo",
               *script]  # fmt: skip
        self.log = open(out / "horovodrun.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=self.log,
                                     stderr=subprocess.STDOUT)  # fmt: skip

    def set_hosts(self, hosts: list[str]) -> None:
        self.hosts_file.write_text("".join(f"{host}:1\n" for host in hosts))

    def progress(self) -> dict[int, list[tuple[int, int]]]:
        """Per process (pid): its (world size, step) lines."""
        found = {}
        for path in self.out.glob("progress-*"):
            lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
            found[int(path.name.split("-")[1])] = [(int(w), int(s)) for w, s in lines]
        return found

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(s >= step for lines in self.progress().values() for _, s in lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()
            time.sleep(0.2)

    def finish(self) -> tuple[int, int, int]:
        assert self.proc.wait(timeout=240) == 0, self.text()
        epochs, world, step = map(int, (self.out / "done").read_text().split())
        return epochs, world, step

    def text(self) -> str:
        self.log.flush()
        return (self.out / "horovodrun.log").read_text()[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def job(tmp_path):
    jobs: list[ElasticJob] = []

    def start(hosts: list[str], np: int) -> ElasticJob:
        jobs.append(ElasticJob(tmp_path, hosts, np))
        return jobs[-1]

    yield start
    for each in jobs:
        each.close()


def test_horovod_elastic_goes_on_after_a_host_is_removed(job):
    run = job(["localhost", "127.0.0.1"], np=2)
    run.wait_for_step(8)
    run.set_hosts(["localhost"])  # one host leaves: its process is stopped by horovodrun
    epochs, world, step = run.finish()
    assert (epochs, world) == (EPOCHS, 1)
    survivors = [lines for lines in run.progress().values() if lines[-1][0] == 1]
    assert len(survivors) == 1
    survivor = survivors[0]
    # one process trained at 2 from step 1, then alone from a commit (not from step 1 again)
    assert survivor[0] == (2, 1) and survivor[-1] == (1, step)
    assert next(s for w, s in survivor if w == 1) > 8


def test_horovod_elastic_takes_in_an_added_host(job):
    run = job(["localhost"], np=1)
    run.wait_for_step(6)
    run.set_hosts(["localhost", "127.0.0.1"])  # a host joins: a new process, rank 0's state
    epochs, world, _ = run.finish()
    assert (epochs, world) == (EPOCHS, 2)
    progress = run.progress()
    assert len(progress) == 2
    first = min(progress, key=lambda pid: progress[pid][0][1])  # the one that began at step 1
    assert progress[first][0] == (1, 1) and progress[first][-1][0] == 2
    joined = next(pid for pid in progress if pid != first)
    assert progress[joined][0][1] > 6  # it began where the group was, with rank 0's state
    finals = [torch.load(path, weights_only=True) for path in run.out.glob("final-*.pt")]
    assert len(finals) == 2 and max_abs_diff(finals[0], finals[1]) == 0.0
