"""LaunchEnv.detect reads what each launcher announces (dicts in; os.environ is untouched)."""

from __future__ import annotations

import pytest

from distkit._env import LaunchEnv

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
    env = LaunchEnv.detect(environ=MPIRUN_ENV, argv=["train.py"])

    assert env == LaunchEnv(launcher="mpirun", rank=2, local_rank=0, world_size=6)
    assert env.is_horovod_launcher
    assert not env.is_torch_launcher


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
