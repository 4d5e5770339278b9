"""LaunchEnv.detect reads what each launcher announces (dicts in; os.environ is untouched)."""

from __future__ import annotations

import re

import pytest

from distkit.errors import ConfigurationError
from distkit.launch._env import DERIVED_PORT_BASE, DERIVED_PORT_SPAN, LaunchEnv
from distkit.launch._hostlist import expand_hostlist

pytestmark = pytest.mark.timeout(60)

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job-1",
}

# The legacy launcher (without --use-env) sets these and passes the local rank on the command line.
LEGACY_LAUNCH_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}

HOROVODRUN_ENV = {"HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1"}

MPIRUN_ENV = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
}


def test_launch_env_detect_plain_process_is_world_of_one():
    env = LaunchEnv.detect(environ={"HOME": "/root", "PATH": "/usr/bin"}, argv=["train.py"])

    assert env == LaunchEnv(launcher="none", rank=0, local_rank=0, world_size=1)
    assert env.master_addr is None and env.master_port is None
    assert not env.is_multiprocess_launcher
    assert not env.is_torch_launcher
    assert not env.is_horovod_launcher


def test_launch_env_detect_torchrun_reads_every_number():
    env = LaunchEnv.detect(environ=TORCHRUN_ENV, argv=["train.py", "--lr", "0.1"])

    assert env == LaunchEnv(
        launcher="torchrun",
        rank=3,
        local_rank=1,
        world_size=4,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    assert env.is_multiprocess_launcher and env.is_torch_launcher
    assert not env.is_horovod_launcher


@pytest.mark.parametrize(
    "argv",
    [
        ["train.py", "--local_rank=1"],
        ["train.py", "--local-rank=1"],
        ["train.py", "--local_rank", "1"],
        ["train.py", "--local-rank", "1", "--epochs", "3"],
    ],
    ids=["underscore-equals", "dash-equals", "underscore-space", "dash-space"],
)
def test_launch_env_detect_legacy_launch_takes_local_rank_from_argv(argv):
    env = LaunchEnv.detect(environ=LEGACY_LAUNCH_ENV, argv=argv)

    assert env.launcher == "torch.distributed.launch"
    assert (env.rank, env.local_rank, env.world_size) == (3, 1, 4)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)
    assert env.is_torch_launcher


def test_launch_env_detect_legacy_launch_argument_wins_over_elastic_run_id():
    # torch.distributed.launch is built on torchelastic, so it sets TORCHELASTIC_RUN_ID too;
    # the --local_rank argument is what tells it apart from torchrun.
    environ = {**LEGACY_LAUNCH_ENV, "TORCHELASTIC_RUN_ID": "job-1"}

    env = LaunchEnv.detect(environ=environ, argv=["train.py", "--local_rank=1"])

    assert env.launcher == "torch.distributed.launch"
    assert env.local_rank == 1


def test_launch_env_detect_local_rank_argument_alone_is_not_a_launcher():
    env = LaunchEnv.detect(environ={}, argv=["train.py", "--local_rank=1"])

    assert env.launcher == "none"
    assert env.world_size == 1


def test_launch_env_detect_horovodrun():
    env = LaunchEnv.detect(environ=HOROVODRUN_ENV, argv=["train.py"])

    assert env == LaunchEnv(launcher="horovodrun", rank=5, local_rank=1, world_size=8)
    assert env.is_horovod_launcher and env.is_multiprocess_launcher
    assert not env.is_torch_launcher


def test_launch_env_detect_mpirun():
    env = LaunchEnv.detect(environ={**MPIRUN_ENV, "PMIX_NAMESPACE": "prterun-vm-1@1"},
                           argv=["train.py"])  # fmt: skip

    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("mpirun", 2, 0, 6)
    assert env.is_horovod_launcher and env.is_cluster_launcher
    assert not env.is_torch_launcher
    # torch.distributed meets on this node by default, at a port every rank derives alike
    assert env.master_addr == "127.0.0.1"
    assert DERIVED_PORT_BASE <= env.master_port < DERIVED_PORT_BASE + DERIVED_PORT_SPAN
    again = LaunchEnv.detect(environ={**MPIRUN_ENV, "OMPI_COMM_WORLD_RANK": "0",
                                      "PMIX_NAMESPACE": "prterun-vm-1@1"}, argv=[])  # fmt: skip
    other_job = LaunchEnv.detect(environ={**MPIRUN_ENV, "PMIX_NAMESPACE": "prterun-vm-2@1"},
                                 argv=[])  # fmt: skip
    assert again.master_port == env.master_port != other_job.master_port


def test_launch_env_detect_mpich_and_explicit_rendezvous():
    environ = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
               "MASTER_ADDR": "node1", "MASTER_PORT": "29400"}  # fmt: skip
    env = LaunchEnv.detect(environ=environ, argv=[])
    assert env == LaunchEnv(launcher="mpirun", rank=1, local_rank=1, world_size=2,
                            master_addr="node1", master_port=29400)  # fmt: skip


SRUN_ENV = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NODEID": "2",
    "SLURM_NNODES": "4",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_NODELIST": "gpu[07-09,12]",
    "SLURM_JOB_NODELIST": "gpu[07-09,12]",
    "SLURM_TASKS_PER_NODE": "2(x4)",
}


def test_launch_env_detect_srun_reads_slurm_variables():
    env = LaunchEnv.detect(environ=SRUN_ENV, argv=["train.py"])

    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("srun", 5, 1, 8)
    assert env.master_addr == "gpu07"  # the first host of the node list
    assert DERIVED_PORT_BASE <= env.master_port < DERIVED_PORT_BASE + DERIVED_PORT_SPAN
    assert env.is_cluster_launcher and env.is_multiprocess_launcher
    assert not env.is_torch_launcher and not env.is_horovod_launcher
    same_job = LaunchEnv.detect(environ={**SRUN_ENV, "SLURM_PROCID": "0"}, argv=[])
    assert same_job.master_port == env.master_port


def test_launch_env_detect_srun_takes_master_address_and_port_from_the_environment():
    environ = {**SRUN_ENV, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29999"}
    env = LaunchEnv.detect(environ=environ, argv=[])
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 29999)


def test_launch_env_salloc_shell_is_a_plain_process():
    # salloc / sbatch shells carry the job's variables but are not a step: no SLURM_PROCID
    shell = {k: v for k, v in SRUN_ENV.items() if k not in ("SLURM_PROCID", "SLURM_LOCALID")}
    assert LaunchEnv.detect(environ=shell, argv=[]) == LaunchEnv()


def test_launch_env_torchrun_inside_a_slurm_step_is_torchrun():
    env = LaunchEnv.detect(environ={**SRUN_ENV, **TORCHRUN_ENV}, argv=[])
    assert env.launcher == "torchrun" and (env.rank, env.world_size) == (3, 4)


def test_launch_env_srun_with_pmi_is_srun_but_mpirun_inside_slurm_is_mpirun():
    pmi = {**SRUN_ENV, "PMI_RANK": "5", "PMI_SIZE": "8"}  # srun --mpi=pmi2
    assert LaunchEnv.detect(environ=pmi, argv=[]).launcher == "srun"
    ompi = {**SRUN_ENV, **MPIRUN_ENV}  # mpirun inside an allocation
    assert LaunchEnv.detect(environ=ompi, argv=[]).launcher == "mpirun"


def test_launch_env_bad_slurm_node_list_names_the_variable():
    words = r"SLURM_NODELIST: SLURM host list 'gpu\[07-': '\[' without"
    with pytest.raises(ValueError, match=words):
        LaunchEnv.detect(environ={**SRUN_ENV, "SLURM_NODELIST": "gpu[07-",
                                  "SLURM_JOB_NODELIST": ""}, argv=[])  # fmt: skip


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
        ("a[1-2]-ib[08-09],login1", ["a1-ib08", "a1-ib09", "a2-ib08", "a2-ib09", "login1"]),
        ("n1, n2", ["n1", "n2"]),
    ],
)
def test_hostlist_expands_slurm_syntax(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "words"),
    [("node[1-", "'[' without ']'"), ("node1]", "']' without '['"),
     ("node[a-b]", "'a-b' is not N or N-M"), ("node[5-2]", "runs backwards"),
     ("", "names no host")],
)  # fmt: skip
def test_hostlist_refuses_malformed_lists(hostlist, words):
    with pytest.raises(ValueError, match=__import__("re").escape(words)):
        expand_hostlist(hostlist)


def test_launch_env_detect_horovodrun_wins_over_mpi_variables():
    # horovodrun runs on top of mpirun in MPI mode, so both sets of variables can be present.
    env = LaunchEnv.detect(environ={**MPIRUN_ENV, **HOROVODRUN_ENV}, argv=["train.py"])

    assert env.launcher == "horovodrun"
    assert (env.rank, env.world_size) == (5, 8)


def test_launch_env_detect_empty_master_port_is_none():
    environ = {**TORCHRUN_ENV, "MASTER_PORT": ""}

    assert LaunchEnv.detect(environ=environ, argv=[]).master_port is None


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({**TORCHRUN_ENV, "RANK": "zero"}, "RANK"),
        ({**TORCHRUN_ENV, "LOCAL_RANK": "1.5"}, "LOCAL_RANK"),
        ({**TORCHRUN_ENV, "WORLD_SIZE": "four"}, "WORLD_SIZE"),
        ({**TORCHRUN_ENV, "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({**HOROVODRUN_ENV, "HOROVOD_SIZE": "eight"}, "HOROVOD_SIZE"),
        ({**MPIRUN_ENV, "OMPI_COMM_WORLD_RANK": "x"}, "OMPI_COMM_WORLD_RANK"),
    ],
)
def test_launch_env_detect_non_integer_value_names_the_variable(environ, variable):
    with pytest.raises(ValueError, match=rf"\b{variable}=") as info:
        LaunchEnv.detect(environ=environ, argv=["train.py"])

    assert repr(environ[variable]) in str(info.value)
    assert "not an integer" in str(info.value)


def test_launch_env_is_frozen():
    env = LaunchEnv()

    with pytest.raises(AttributeError):
        env.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({**SRUN_ENV, "SLURM_PROCID": "8"}, "SLURM_PROCID=8 with SLURM_NTASKS=8: a rank must lie "
         "in 0..7"),
        ({**SRUN_ENV, "SLURM_PROCID": "-1"}, "SLURM_PROCID=-1 with SLURM_NTASKS=8"),
        ({**SRUN_ENV, "SLURM_NTASKS": "0"}, "SLURM_NTASKS=0 (with SLURM_PROCID=5): the world size "
         "must be >= 1"),
        ({"SLURM_PROCID": "3", "SLURM_NPROCS": "2"}, "SLURM_PROCID=3 with SLURM_NPROCS=2"),
        ({"SLURM_PROCID": "1"}, "SLURM_PROCID=1 with no world size set (so 1)"),
        ({**TORCHRUN_ENV, "RANK": "4"}, "RANK=4 with WORLD_SIZE=4: a rank must lie in 0..3"),
        ({**HOROVODRUN_ENV, "HOROVOD_RANK": "8"}, "HOROVOD_RANK=8 with HOROVOD_SIZE=8"),
        ({**MPIRUN_ENV, "OMPI_COMM_WORLD_RANK": "6"}, "OMPI_COMM_WORLD_RANK=6 with "
         "OMPI_COMM_WORLD_SIZE=6"),
    ],
)  # fmt: skip
def test_launch_env_detect_refuses_a_rank_outside_the_world(environ, words):
    """Before, SLURM_PROCID=8 of SLURM_NTASKS=8 was read as is: that task waited at the
    rendezvous for a world it could not join (the 30-minute time-out)."""
    with pytest.raises(ConfigurationError, match=re.escape(words)) as info:
        LaunchEnv.detect(environ=environ, argv=["train.py"])
    fix = "srun python train.py" if "SLURM_PROCID" in environ else "unset it"
    assert fix in str(info.value)


def test_launch_env_detect_accepts_the_last_rank():
    env = LaunchEnv.detect(environ={**SRUN_ENV, "SLURM_PROCID": "7"}, argv=["train.py"])
    assert (env.launcher, env.rank, env.world_size) == ("srun", 7, 8)


def test_derived_ports_stay_below_the_kernels_ephemeral_range():
    """A derived port in Linux's ephemeral range (32768-60999) could be held by any outgoing
    connection or port-0 listener on the first node (gloo's among them): rank 0's store then
    failed with EADDRINUSE (seen once in CI, port 33940 for a random SLURM job id)."""
    from distkit.launch._env import LINUX_EPHEMERAL_START

    assert DERIVED_PORT_BASE + DERIVED_PORT_SPAN <= LINUX_EPHEMERAL_START
    ports = set()
    for job in range(0, 200_000, 7):
        slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": str(job)}
        ports.add(LaunchEnv.detect(environ=slurm, argv=[]).master_port)
        mpi = {**MPIRUN_ENV, "PMIX_NAMESPACE": f"prterun-node-{job}@1"}
        ports.add(LaunchEnv.detect(environ=mpi, argv=[]).master_port)
    assert min(ports) >= DERIVED_PORT_BASE and max(ports) < LINUX_EPHEMERAL_START
    assert len(ports) > DERIVED_PORT_SPAN // 2  # spread over the range, not a few ports
