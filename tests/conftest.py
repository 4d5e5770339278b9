from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.support.multiprocess import run_on_ranks as _run_on_ranks
from tests.support.signals import dispositions

# One thread per process: the machines have 2 cores, multi-rank tests run 2 processes, and a
# parent without an OpenMP pool forks safely.
torch.set_num_threads(1)


def _hide_a_lone_gpu_from_child_processes() -> None:
    """With ``DISTKIT_TESTS_HIDE_LONE_GPU=1`` on a one-GPU machine, the processes the tests
    start see no GPU, and this process keeps it.

    The multi-process tests start 2 to 4 ranks; distkit gives each rank a GPU of its own and
    refuses one without (NCCL refuses two ranks on one GPU), so on one GPU they fail before
    their first step. scripts/gpu_check.sh sets the variable: then they run on the CPU, as in
    CI, and the tests that train in this process run on the GPU. This process initialises
    CUDA and counts its devices first: torch caches the count once CUDA is initialised, and
    reads ``CUDA_VISIBLE_DEVICES`` again on every count before that.
    """
    if os.environ.get("DISTKIT_TESTS_HIDE_LONE_GPU") != "1" or not torch.cuda.is_available():
        return
    torch.cuda.init()
    if torch.cuda.device_count() == 1:  # counted after init(): cached for this process
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session", autouse=True)
def _lone_gpu_hidden_from_children():
    """In the processes that run tests only (not pytest-xdist's controller, whose workers
    are its children and must keep the GPU)."""
    _hide_a_lone_gpu_from_child_processes()
    yield


def _preload_heavy_backends() -> None:
    """The fork server that run_on_ranks starts ranks from imports DeepSpeed and transformers'
    GPT-2 once (tests/support/fork_preload.py), so no rank imports them again: about 0.8 s
    and 2.3 s of every rank's start, over some 60 DeepSpeed runs and a dozen transformers
    ones. Only without CUDA: DeepSpeed picks its accelerator when it is imported, and on a
    GPU machine the ranks run with the GPU hidden (above) while the fork server would see it."""
    from distkit.testing import _processes

    if not torch.cuda.is_available():
        _processes.PRELOAD.append("tests.support.fork_preload")


_preload_heavy_backends()

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
    """Run a module-level function on N real gloo processes (see tests/support/multiprocess.py).

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


@pytest.fixture(autouse=True)
def _signals_put_back():
    """Fail a test that leaves a signal handler (or the wakeup fd) other than it found it,
    and put them back: a disposition left behind changes what every later test's children
    inherit (tests/support/signals.py), and fails a test far from the one to blame."""
    import signal

    before = dispositions()
    yield
    after = dispositions()
    changed = {name: (before[name], after[name]) for name in before if after[name] != before[name]}
    for name, (was, _) in changed.items():
        if name == "wakeup_fd":
            signal.set_wakeup_fd(was)
        elif was is not None:  # None: a handler installed outside Python, not restorable
            signal.signal(getattr(signal, name), was)
    assert not changed, f"test left signal dispositions changed (before, after): {changed}"


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback, one per test process (tests/support/s3_server.py)."""
    from tests.support.s3_server import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    """A new, empty bucket's URL (``s3://...``) on :func:`s3_endpoint`, with this process's
    environment (and its children's) pointing at that endpoint as their S3."""
    from tests.support.s3_server import point_environment_at

    point_environment_at(s3_endpoint, monkeypatch)
    return s3_endpoint.new_bucket()
