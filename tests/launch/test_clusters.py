"""Cluster launchers on this machine: SLURM-style steps, mpirun, two torchrun "nodes" and
horovodrun over two host entries, each equal to one process at the global batch.

Every launch runs tests/support/job_scripts/cluster_job.py: 2 epochs with a checkpoint per
epoch written by rank 0, then a new Trainer resumes from that folder on every rank and trains a
third epoch (a shared filesystem, as a cluster's). The reference is one plain process at 2x the
batch.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.exactness import TOL
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.mpi import mpich_bin, mpirun_path
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(300)

JOB = ["-m", "tests.support.job_scripts.cluster_job"]
TOLERANCE = TOL  # the job trains in float64 (tests/support/exactness.py)
# what a launcher may leave in the test runner's environment, and must not reach the jobs
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "HOROVOD_RANK", "HOROVOD_SIZE")  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI"))}  # fmt: skip
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def _wait(procs: list[subprocess.Popen], timeout: float = 240) -> str:
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        outputs.append(out)
        assert proc.returncode == 0, out[-4000:]
    return "\n".join(outputs)


def _start(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _results(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, torch.Tensor]:
    """One plain python process at batch 8 (the reference)."""
    out = tmp_path_factory.mktemp("one")
    _wait([_start([sys.executable, *JOB, "auto", "8", str(out)], _env(), out)])
    (result,) = _results(out, 1)
    assert (result["strategy"], result["world_size"]) == ("dp", 1)
    return result["state"]


def _check(out: Path, one: dict[str, torch.Tensor], strategy: str) -> None:
    ranks = _results(out, 2)
    for rank, result in enumerate(ranks):
        assert (result["strategy"], result["world_size"]) == (strategy, 2), result
        diff = max_abs_diff(result["state"], one)
        assert diff <= TOLERANCE, f"rank {rank} ends {diff:.3g} away from one process"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- SLURM
def test_clusters_srun_style_tasks_train_as_one_job_with_auto(tmp_path, one_process):
    """Two plain python processes with only the variables srun sets: strategy="auto" -> ddp,
    one job (before, each trained alone: a silent wrong result)."""
    job_id = str(random.randrange(10**6, 10**7))  # the derived port differs per test run
    procs = [
        _start([sys.executable, *JOB, "auto", "4", str(tmp_path)], _env(
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
            SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_ID=job_id, SLURM_STEP_ID="0",
            SLURM_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
            SLURM_TASKS_PER_NODE="2",
        ), tmp_path)
        for rank in range(2)
    ]  # fmt: skip
    _wait(procs)
    _check(tmp_path, one_process, "ddp")


def test_clusters_srun_sweep_reuses_the_job_store_whatever_the_timeout(tmp_path):
    """Two Trainers per task with different collective timeouts: one store per process."""
    job_id = str(random.randrange(10**6, 10**7))
    procs = [
        _start([sys.executable, "-m", "tests.support.job_scripts.sweep_job", str(tmp_path)], _env(
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
            SLURM_JOB_ID=job_id, SLURM_NODELIST="localhost",
        ), tmp_path)
        for rank in range(2)
    ]  # fmt: skip
    _wait(procs, 120)
    losses = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert losses[0] == losses[1] and len(losses[0].split()) == 2


def test_clusters_salloc_shell_is_one_process_not_a_broken_group(tmp_path, one_process):
    """An allocation's shell (no SLURM_PROCID) with SLURM_NTASKS=2 trains alone, at once."""
    env = _env(SLURM_JOB_ID="77", SLURM_NTASKS="2", SLURM_NODELIST="localhost")
    _wait([_start([sys.executable, *JOB, "auto", "8", str(tmp_path)], env, tmp_path)], 120)
    (result,) = _results(tmp_path, 1)
    assert result["world_size"] == 1
    assert max_abs_diff(result["state"], one_process) <= TOLERANCE


# ---------------------------------------------------------------- mpirun
def _mpirun_cmd(strategy: str) -> list[str]:
    mpirun = mpirun_path()
    assert mpirun is not None
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *as_root, "--oversubscribe", "-np", "2", sys.executable, *JOB, strategy, "4"]


@needs("mpirun")
@pytest.mark.parametrize("strategy", ["ddp", "auto"])
def test_clusters_mpirun_runs_ddp_as_one_job(tmp_path, one_process, strategy):
    from distkit.strategies.horovod._horovodrun import horovod_has_mpi

    if strategy == "auto" and horovod_has_mpi():
        pytest.skip("this Horovod has MPI: auto picks horovod under mpirun")
    output = _wait([_start([*_mpirun_cmd(strategy), str(tmp_path)], _env(), tmp_path)])
    _check(tmp_path, one_process, "ddp")
    if strategy == "auto":  # it says which backend it picked: rank 0, once per Trainer (2)
        assert output.count("strategy='auto' under mpirun runs 'ddp'") == 2


@needs("mpirun")
def test_clusters_mpirun_refuses_a_horovod_without_mpi(tmp_path):
    """A Gloo-only Horovod under mpirun would train each process alone: refused, saying why."""
    from distkit.strategies.horovod._horovodrun import horovod_has_mpi

    pytest.importorskip("horovod.torch")
    if horovod_has_mpi():
        pytest.skip("this Horovod has MPI")
    proc = _start([*_mpirun_cmd("horovod"), str(tmp_path)], _env(), tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "mpirun started 2 processes but Horovod sees 1" in out
    assert not list(tmp_path.glob("rank*.pt"))


@needs("mpich")
def test_clusters_mpich_mpiexec_runs_ddp_as_one_job(tmp_path, one_process):
    """MPICH's hydra sets PMI_RANK / PMI_SIZE / MPI_LOCALRANKID (no PMIx namespace): the
    rendezvous port comes from the launcher's process, the same for every rank."""
    folder = mpich_bin()
    assert folder is not None
    env = _env(PATH=f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [str(Path(folder, "mpiexec")), "-n", "2", sys.executable, *JOB, "ddp", "4",
           str(tmp_path)]  # fmt: skip
    _wait([_start(cmd, env, tmp_path)])
    _check(tmp_path, one_process, "ddp")


# ---------------------------------------------------------------- torchrun across two nodes
def test_clusters_two_torchrun_nodes_equal_one_process(tmp_path, one_process):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), one process each."""
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [
        _start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", f"nodes-{endpoint}",
                *JOB, "auto", "4", str(tmp_path)], _env(), tmp_path)
        for node in range(2)
    ]  # fmt: skip
    _wait(agents)
    _check(tmp_path, one_process, "ddp")


# ---------------------------------------------------------------- horovodrun over two hosts
@needs("horovod")
def test_clusters_horovodrun_over_two_host_entries_equals_one_process(tmp_path, one_process):
    """-H localhost:1,127.0.0.1:1: Horovod sees two hosts (cross size 2, local size 1)."""
    hvd = [horovodrun_path(), "-np", "2", "-H", "localhost:1,127.0.0.1:1", "--gloo",
           sys.executable, *JOB, "horovod", "4", str(tmp_path)]  # fmt: skip
    _wait([_start(hvd, _env(), tmp_path)])
    _check(tmp_path, one_process, "horovod")


def test_clusters_rank_zero_says_why_when_the_other_tasks_never_come(monkeypatch, capsys):
    """An sbatch script that runs python itself: SLURM calls its one process rank 0 of
    SLURM_NTASKS. Rank 0 waits (the others might be slow to start) but says what may be
    wrong; here with the hint after 0.2 s and a 1.5 s limit instead of 30 s and 30 min."""
    from datetime import timedelta

    from distkit.strategies import _torch_group

    monkeypatch.setattr(_torch_group, "JOIN_HINT_S", 0.2)
    with pytest.raises(TimeoutError, match="only 1 of 2 tasks reached the store"):
        _torch_group._job_store("127.0.0.1", _free_port(), 2, 0, timedelta(seconds=1.5))
    assert "start the tasks with srun" in capsys.readouterr().err


def test_clusters_a_rank_whose_peers_never_come_says_where_it_waits(tmp_path):
    """Only rank 1 of an srun step started: it waits for rank 0's store. Before, it waited in
    silence until the rendezvous time-out (30 minutes by default); now it names the address,
    the ranks it waits for and what to check, after half the time-out (2 s of 4 s here)."""
    port = _free_port()
    env = _env(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NTASKS="2", SLURM_JOB_ID="77",
               SLURM_NODELIST="localhost", MASTER_PORT=str(port))  # fmt: skip
    code = "import distkit; distkit.Trainer('auto', collective_timeout=4, progress=False)"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    hint = (f"distkit: rank 1 of 2 (srun) has waited 2s at the rendezvous localhost:{port} for "
            "ranks 0..1 (rank 0 hosts it). Check that every task started")  # fmt: skip
    assert hint in proc.stderr, proc.stderr[-3000:]
    assert "LauncherMismatchError: rank 1 of a srun job could not meet the others" in proc.stderr
    assert proc.stderr.index(hint) < proc.stderr.index("LauncherMismatchError")
    assert elapsed < 60, f"{elapsed:.0f}s"


# ---------------------------------------------------------------- two network namespaces
def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: each "host" has its own loopback and
    address (10.77.x.1 and 10.77.x.2), as two machines on one network. Needs root and
    iproute2 (skips without)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (`ip netns`) to make two network namespaces")
    tag = f"{os.getpid() % 10000}"
    names, subnet = (f"dka{tag}", f"dkb{tag}"), f"10.77.{os.getpid() % 250}"
    steps = [
        ("netns", "add", names[0]), ("netns", "add", names[1]),
        ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
        ("link", "set", f"va{tag}", "netns", names[0]),
        ("link", "set", f"vb{tag}", "netns", names[1]),
        ("-n", names[0], "addr", "add", f"{subnet}.1/24", "dev", f"va{tag}"),
        ("-n", names[1], "addr", "add", f"{subnet}.2/24", "dev", f"vb{tag}"),
        ("-n", names[0], "link", "set", f"va{tag}", "up"),
        ("-n", names[1], "link", "set", f"vb{tag}", "up"),
        ("-n", names[0], "link", "set", "lo", "up"), ("-n", names[1], "link", "set", "lo", "up"),
    ]  # fmt: skip
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: ip {' '.join(step)}: "
                            f"{done.stderr.strip()}")  # fmt: skip
        yield [(names[0], f"va{tag}", f"{subnet}.1"), (names[1], f"vb{tag}", f"{subnet}.2")]
    finally:
        for name in names:
            _ip("netns", "del", name)


def test_clusters_two_torchrun_hosts_in_network_namespaces_equal_one_process(
    tmp_path, one_process, two_hosts
):
    """Two torchrun agents on two "machines" (network namespaces, a veth link between them):
    node 0 hosts the rendezvous at its own address, Gloo runs over the link."""
    (ns0, _, addr0), _ = two_hosts
    agents = []
    for node, (ns, interface, addr) in enumerate(two_hosts):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr0}:29611",
               "--rdzv-id", f"ns-{ns0}", "--rdzv-conf", f"is_host={str(node == 0).lower()}",
               "--local-addr", addr, *JOB, "auto", "4", str(tmp_path)]  # fmt: skip
        agents.append(_start(cmd, _env(GLOO_SOCKET_IFNAME=interface), tmp_path))
    _wait(agents)
    _check(tmp_path, one_process, "ddp")
