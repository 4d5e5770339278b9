from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.multiprocess import run_on_ranks as _run_on_ranks

# One thread per process: the machines have 2 cores, multi-rank tests run 2 processes, and a
# parent without an OpenMP pool forks safely.
torch.set_num_threads(1)

_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


@pytest.fixture
def run_on_ranks():
    """Run a module-level function on N real gloo processes (see tests/multiprocess.py).

    The rendezvous store lives in the test process, as torchrun's agent keeps it: a rank-0
    hosted store goes with rank 0's group, under a slower rank still using it (tests that
    create several Trainers per rank flaked on that). Pass agent_store=False for the rank-0
    case.
    """
    return functools.partial(_run_on_ranks, agent_store=True)


@pytest.fixture(autouse=True)
def _no_leaks():
    """Fail a test that leaves launcher variables or a live process group behind."""
    before = {key: os.environ.get(key) for key in _LAUNCHER_VARS}
    yield
    after = {key: os.environ.get(key) for key in _LAUNCHER_VARS}
    leaked_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if leaked_group:
        torch.distributed.destroy_process_group()
    assert after == before, f"test leaked launcher environment variables: {after}"
    assert not leaked_group, "test left a torch.distributed process group alive"
