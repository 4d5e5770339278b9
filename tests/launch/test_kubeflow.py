"""Kubeflow training-operator pods: what each kind of pod is given, and real jobs run with it.

The variables are those kubeflow/training-operator sets (v1.9.0, pkg/controller.v1/pytorch:
envvar.go, master.go, elastic.go; Trainer v2's torch plugin for a TrainJob). The jobs run the
master and worker replicas as processes on this machine, MASTER_ADDR=127.0.0.1 standing in for
the master's service, and each must equal one plain process at the combined batch.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from distkit import doctor
from distkit.errors import ConfigurationError
from distkit.launch._env import LaunchEnv
from distkit.launch.diagnosis import collect_machine
from distkit.registry import auto_strategy_name
from tests.support.exactness import TOL  # cluster_job trains in float64
from tests.support.job_scripts import cluster_job
from tests.support.jobs import run_job
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(180)

POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def replica_env(rank: int, world: int = 2, nproc: str = "auto", port: int = 23456) -> dict:
    """What a PyTorchJob (v1.7+, no elastic policy) gives replica ``rank``: the master is
    rank 0, worker i is rank i + 1; WORLD_SIZE is pods x nprocPerNode (when a number)."""
    per_pod = int(nproc) if nproc.isdigit() else 1
    return {
        **POD,
        "HOSTNAME": "job-master-0" if rank == 0 else f"job-worker-{rank - 1}",
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": str(port),
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": str(world * per_pod),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NNODES": str(world),
    }


# ---------------------------------------------------------------- what each pod is recognised as
def test_kubeflow_replica_run_as_python_is_one_rank_per_pod():
    worker = LaunchEnv.detect(replica_env(1), argv=["train.py"])

    expected = {"master_addr": "job-master-0", "master_port": 23456, "pod": "kubeflow"}
    assert worker == LaunchEnv(launcher="kubeflow", rank=1, world_size=2, **expected)
    assert worker.is_cluster_launcher and not worker.is_torch_launcher
    assert auto_strategy_name(worker) == "ddp"


def test_kubeflow_replica_before_v1_7_is_known_by_its_master_address():
    """v1.0-v1.6 set no PET_* variables: MASTER_ADDR names the master replica's pod."""
    old = {**POD, "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3",
           "RANK": "2", "PYTHONUNBUFFERED": "0"}  # fmt: skip

    assert LaunchEnv.detect(old, argv=["train.py"]).launcher == "kubeflow"


def test_kubeflow_torchrun_in_the_pod_is_torchrun_whose_world_counts_processes():
    """torchrun replaces RANK and WORLD_SIZE in the processes it starts (2 pods x 2)."""
    started = {**replica_env(1, nproc="2"), "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
               "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip

    env = LaunchEnv.detect(started, argv=["train.py"])

    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("torchrun", 3, 1, 4)
    assert env.pod == "kubeflow"


def test_kubeflow_refuses_python_where_world_size_counts_torchruns_processes():
    """nprocPerNode 2: WORLD_SIZE=4, but one python per pod makes 2: the group cannot form."""
    with pytest.raises(ConfigurationError, match=r"WORLD_SIZE=4 counts processes .*torchrun"):
        LaunchEnv.detect(replica_env(0, nproc="2"), argv=["train.py"])


@pytest.mark.parametrize(
    "pet",
    [
        {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",  # TrainJob
         "PET_MASTER_ADDR": "job-trainer-node-0-0.job", "PET_MASTER_PORT": "29500"},
        {"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "job-worker-0:23456",  # elastic policy
         "PET_RDZV_BACKEND": "c10d", "PET_NPROC_PER_NODE": "1"},
        {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0"},
    ],
)  # fmt: skip
def test_kubeflow_refuses_python_in_a_pod_set_up_for_torchrun_only(pet):
    """No RANK/WORLD_SIZE, only torchrun's arguments: each pod would train alone."""
    with pytest.raises(ConfigurationError, match=re.escape("`torchrun train.py`")):
        LaunchEnv.detect({**POD, **pet}, argv=["train.py"])


def test_kubeflow_one_node_one_process_job_and_other_pods_are_plain_processes():
    one = LaunchEnv.detect({**POD, "PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto"}, argv=[])
    any_pod = LaunchEnv.detect({**POD, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
                                "MASTER_PORT": "29500"}, argv=[])  # fmt: skip

    assert (one.launcher, one.world_size, one.pod) == ("none", 1, "kubeflow")
    assert (any_pod.launcher, any_pod.pod) == ("torch.distributed.launch", "kubernetes")


def test_kubeflow_doctor_names_the_pod_or_why_it_cannot_run(monkeypatch):
    for key, value in replica_env(1).items():
        monkeypatch.setenv(key, value)
    text = doctor.render_text(doctor.examine(["ddp"]))
    assert "launcher  kubeflow (rank 1 of 2)  ->  strategy='auto' picks ddp" in text

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_RANK", "0")
    text = doctor.render_text(doctor.examine(["ddp"]))
    assert "launcher  torchrun in a Kubeflow job's pod (rank 1 of 2)" in text

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "LOCAL_RANK"):  # fmt: skip
        monkeypatch.delenv(key)
    machine = collect_machine()
    assert machine.launcher.launcher == "none" and "PET_NNODES=2" in str(machine.launcher_problem)
    assert "strategy='auto' picks nothing (this pod is one of" in doctor.render_text(
        doctor.examine(["ddp"], machine=machine)
    )


# ---------------------------------------------------------------- real jobs
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _base_env() -> dict[str, str]:
    """This environment without any launcher's variables, as a fresh pod's."""
    launchers = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "HOROVOD_RANK", "HOROVOD_SIZE"}  # fmt: skip
    prefixes = ("SLURM_", "OMPI_", "PMI", "PET_")
    env = {k: v for k, v in os.environ.items() if k not in launchers and not k.startswith(prefixes)}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def _run_pods(commands: list[list[str]], envs: list[dict[str, str]], out: Path) -> None:
    """Start every pod's command at once; each must exit 0 (stacks of all on a hang)."""
    with ThreadPoolExecutor(len(commands)) as pool:
        jobs = [pool.submit(run_job, cmd, env=env, cwd=out, timeout=150)
                for cmd, env in zip(commands, envs, strict=True)]  # fmt: skip
        for job in jobs:
            done = job.result()
            assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The reference: this process alone at the combined batch (8), as a plain python run."""
    out = tmp_path_factory.mktemp("one")
    cluster_job.train("auto", 8, out)
    result = torch.load(out / "rank0.pt", weights_only=True)
    assert (result["strategy"], result["world_size"]) == ("dp", 1)
    return result["state"]


def _check(out: Path, one: dict[str, torch.Tensor], world: int = 2) -> None:
    for rank in range(world):
        result = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert (result["strategy"], result["world_size"]) == ("ddp", world), result
        assert max_abs_diff(result["state"], one) <= TOL, f"rank {rank} differs"


JOB = ["-m", "tests.support.job_scripts.cluster_job", "auto", "4"]


def test_kubeflow_master_and_worker_replicas_train_as_one_ddp_job(tmp_path, one_process):
    """`python train.py` in each pod, strategy="auto": one 2-rank DDP group."""
    port = _free_port()
    envs = [{**_base_env(), **replica_env(rank, port=port), "MASTER_ADDR": "127.0.0.1"}
            for rank in range(2)]  # fmt: skip
    _run_pods([[sys.executable, *JOB, str(tmp_path)]] * 2, envs, tmp_path)
    _check(tmp_path, one_process)


def test_kubeflow_elastic_policy_pods_run_torchrun_from_pet_variables(tmp_path, one_process):
    """An elastic policy's two worker pods: `torchrun` with no launcher arguments reads
    PET_NNODES, PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_NPROC_PER_NODE (c10d rendezvous)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    pet = {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": endpoint, "PET_RDZV_BACKEND": "c10d",
           "PET_NPROC_PER_NODE": "1", "PET_MAX_RESTARTS": "0"}  # fmt: skip
    envs = [{**_base_env(), **POD, **pet, "HOSTNAME": f"job-worker-{i}"} for i in range(2)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", *JOB, str(tmp_path)]
    _run_pods([torchrun] * 2, envs, tmp_path)
    _check(tmp_path, one_process)


def test_kubeflow_torchrun_with_nproc_per_node_two_in_one_pod(tmp_path, one_process):
    """nprocPerNode 2, one master pod: WORLD_SIZE=2 counts processes; torchrun reads
    PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT, PET_NPROC_PER_NODE and starts 2."""
    env = {**_base_env(), **replica_env(0, world=1, nproc="2", port=_free_port())}
    env.update(MASTER_ADDR="127.0.0.1", PET_MASTER_ADDR="127.0.0.1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", *JOB, str(tmp_path)]
    _run_pods([torchrun], [env], tmp_path)
    _check(tmp_path, one_process)
