"""Elastic torchrun on simulated nodes: a node leaves, a node joins; the job continues from
its checkpoints at the new world size and ends with the weights of an uninterrupted run.

Each "node" is a torchrun agent (``--nnodes 1:2 --nproc-per-node 1``) in a session of its
own, so that killing a node kills its agent and its worker together (SIGKILL: no clean-up).
The c10d rendezvous store is hosted by the test (as an external rendezvous service would
be): with torchrun's default, the first agent hosts it, and losing that node ends the job.
The script keeps the global batch fixed (``batch_size = 8 // world_size``), so the world-size
rule makes the training the same at any process count.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.support.exactness import TOL
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(400)

TOLERANCE = TOL  # the job trains in float64 (tests/support/exactness.py)
STEPS = 24  # 3 epochs of 64 samples at a global batch of 8


def _env() -> dict[str, str]:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_node(pid: int) -> None:
    """SIGKILL an agent and every process under it (torchrun puts its workers in sessions of
    their own, so its process group is not enough)."""
    for victim in [pid, *_descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


class Nodes:
    """torchrun agents sharing one rendezvous store that the test hosts."""

    def __init__(self, out: Path, pause: float) -> None:
        self.out, self.pause = out, pause
        self.store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                                wait_for_workers=False,
                                                timeout=timedelta(minutes=5))  # fmt: skip
        self.agents: list[subprocess.Popen] = []

    def start(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{self.store.port}", "--rdzv-id", "elastic",
               "--rdzv-conf", "last_call_timeout=2", "--monitor-interval", "0.5",
               "-m", "tests.support.job_scripts.elastic_job", str(self.out),
               str(self.pause)]  # fmt: skip
        log = open(self.out / f"agent{len(self.agents)}.log", "w")  # noqa: SIM115
        # torch 2.13's agents share one TCP store across rendezvous rounds; a node that joins
        # later waits for a MASTER_ADDR that the rank-0 agent never publishes again (it
        # built it in round 0): each round must rebuild it (docs/clusters.md)
        env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        agent = subprocess.Popen(cmd, env=env, cwd=self.out, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.agents.append(agent)
        return agent

    def progress(self) -> list[tuple[int, int]]:
        path = self.out / "progress"
        lines = path.read_text().split("\n") if path.exists() else []
        return [tuple(map(int, line.split())) for line in lines if line.strip()]  # type: ignore[misc]

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.progress()):
            if time.monotonic() > deadline or all(a.poll() is not None for a in self.agents):
                raise AssertionError(f"{what}: progress {self.progress()[-5:]}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(self.out.glob("agent*.log")))

    def finish(self, survivors: list[subprocess.Popen]) -> None:
        for agent in survivors:
            assert agent.wait(timeout=240) == 0, self.logs()

    def close(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                _kill_node(agent.pid)
                agent.wait(timeout=10)


@pytest.fixture
def nodes(tmp_path):
    made: list[Nodes] = []

    def make(pause: float = 0.25) -> Nodes:
        made.append(Nodes(tmp_path / f"run{len(made)}", pause))
        made[-1].out.mkdir()
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same script as one plain process, never interrupted."""
    out = tmp_path_factory.mktemp("uninterrupted")
    subprocess.run([sys.executable, "-m", "tests.support.job_scripts.elastic_job", str(out)],
                   env=_env(), cwd=out, check=True, capture_output=True, timeout=240)  # fmt: skip
    return torch.load(out / "final.pt", weights_only=True)


def test_elastic_torchrun_survives_losing_a_node(nodes, uninterrupted):
    run = nodes()
    survivor, leaving = run.start(), run.start()
    run.wait_for(lambda p: any(world == 2 and step >= 7 for world, step in p), "2 nodes train")
    _kill_node(leaving.pid)  # the node is gone: its agent and its worker
    run.finish([survivor])
    worlds = [world for world, _ in run.progress()]
    assert worlds[0] == 2 and worlds[-1] == 1, worlds  # it went on alone
    assert run.progress()[-1][1] == STEPS
    final = torch.load(run.out / "final.pt", weights_only=True)
    assert max_abs_diff(final, uninterrupted) <= TOLERANCE


def test_elastic_torchrun_takes_in_a_joining_node(nodes, uninterrupted):
    run = nodes()
    first = run.start()
    run.wait_for(lambda p: any(step >= 5 for _, step in p), "one node trains")
    second = run.start()  # a node joins: the agent restarts its worker into a 2-node world
    run.finish([first, second])
    worlds = [world for world, _ in run.progress()]
    assert worlds[0] == 1 and worlds[-1] == 2, worlds
    final = torch.load(run.out / "final.pt", weights_only=True)
    assert max_abs_diff(final, uninterrupted) <= TOLERANCE
