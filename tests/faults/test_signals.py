"""SIGTERM and Ctrl-C end a rank within the grace, even while its main thread is blocked in C++.

Real processes: two DDP ranks started with torchrun's variables (no agent, so each worker's own
exit status is seen). Rank 1 sleeps in Python before a collective while rank 0 waits in DDP's
gradient all-reduce; the signal goes to rank 0 only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from tests.support.multiprocess import free_port, torchrun_env
from tests.support.paths import ROOT
from tests.support.signals import assert_takes_ctrl_c, ctrl_c_delivered
from tests.support.workloads import make_dataset

pytestmark = pytest.mark.timeout(240)

BLOCKED_JOB = str(ROOT / "tests" / "support" / "job_scripts" / "blocked_job.py")
GRACE = 3.0  # the job's fault_timeout: the grace after a signal
SLEEP = 60.0  # rank 1's nap: without the fix rank 0 stays until it ends (or 30 min with NCCL)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _wait_for(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never started: {paths}"
        time.sleep(0.1)


def _start(command: list[str], launcher_env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_env(), **launcher_env},
        start_new_session=True,  # a signal reaches this process only
        **ctrl_c_delivered(),  # as from a terminal, whatever this run was started with
    )


def _signal_blocked_rank(
    out: Path, signum: int, *, runtime: bool = False
) -> tuple[int, float, str, str]:
    """Send ``signum`` to rank 0 while it waits in a collective; its status, seconds to end,
    its output and rank 1's output. ``runtime``: the job is a user's loop on the Runtime."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, BLOCKED_JOB, str(out), "--grace", str(GRACE), "--sleep", str(SLEEP)]
    command += ["--runtime"] if runtime else []
    procs = [_start(command, torchrun_env(rank, 2, port)) for rank in (0, 1)]
    try:
        _wait_for([out / "started_0", out / "started_1"], 120)
        time.sleep(2.0)  # rank 0 runs its backward pass and blocks in the all-reduce
        assert procs[0].poll() is None
        if signum == signal.SIGINT:
            assert_takes_ctrl_c(procs[0].pid)
        start = time.monotonic()
        procs[0].send_signal(signum)
        output0, _ = procs[0].communicate(timeout=SLEEP + 60)
        seconds = time.monotonic() - start
        procs[1].send_signal(signal.SIGTERM)  # what the launcher does once a worker has gone
        output1, _ = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"rank 0 ended {seconds:.1f}s after signal {signum}, status {procs[0].returncode}")
    return procs[0].returncode, seconds, output0, output1


@pytest.mark.parametrize(
    ("signum", "status", "words"),
    [
        pytest.param(signal.SIGTERM, 143, "terminated (SIGTERM)", id="sigterm"),
        pytest.param(signal.SIGINT, 130, "interrupted (Ctrl-C)", id="sigint"),
    ],
)
def test_signals_end_a_rank_blocked_in_a_collective_within_the_grace(
    tmp_path, signum, status, words
):
    code, seconds, output, _ = _signal_blocked_rank(tmp_path, signum)
    assert code == status, output[-3000:]
    # it waits the grace for its main thread (which may yet come back and run the handlers),
    # then ends: far below rank 1's 60 s nap, which is what ended it before
    assert GRACE - 0.5 <= seconds <= GRACE + 20, (seconds, output[-3000:])
    assert f"distkit: rank 0 {words} in epoch 1, step 3;" in output, output[-3000:]
    assert "blocked" in output and "Traceback" not in output, output[-3000:]


@pytest.mark.parametrize(
    ("signum", "status", "words"),
    [
        pytest.param(signal.SIGTERM, 143, "terminated (SIGTERM)", id="sigterm"),
        pytest.param(signal.SIGINT, 130, "interrupted (Ctrl-C)", id="sigint"),
    ],
)
def test_signals_end_a_user_loop_blocked_in_a_collective_within_the_grace(
    tmp_path, signum, status, words
):
    """The same inside ``with distkit.Runtime(...)``: a user's own loop gets the Trainer's
    guard (before it, rank 0 waited in the all-reduce until rank 1's nap ended)."""
    code, seconds, output, _ = _signal_blocked_rank(tmp_path, signum, runtime=True)
    assert code == status, output[-3000:]
    assert GRACE - 0.5 <= seconds <= GRACE + 20, (seconds, output[-3000:])
    assert f"distkit: rank 0 {words} in epoch 1, step 3;" in output, output[-3000:]
    assert "blocked" in output and "Traceback" not in output, output[-3000:]


def _fit(trainer: distkit.Trainer, step_fn) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(48),
                step_fn=step_fn)  # fmt: skip


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _ctrl_c_caught(grace: float) -> dict:
    """Ctrl-C on every rank while in Python; the user catches it and works on past the grace."""
    at_start = signal.getsignal(signal.SIGINT)  # run_on_ranks starts ranks as torchrun does
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False, fault_timeout=grace)
    calls = {"n": 0}

    def step_fn(model: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return _loss(model, batch)

    try:
        _fit(trainer, step_fn)
        caught = "nothing"
    except KeyboardInterrupt as exc:
        caught = f"{type(exc).__name__}: {exc}"
    time.sleep(grace + 3)  # the user's own work after the interrupt, longer than the grace
    return {"caught": caught, "at_start": at_start, "handler": signal.getsignal(signal.SIGINT)}


def test_signals_a_ctrl_c_the_main_thread_took_is_the_user_s_to_handle(run_on_ranks):
    # the SIGINT's grace timer only ends a rank whose main thread never took the signal
    for result in run_on_ranks(_ctrl_c_caught, 4.0, world_size=2, timeout=120):
        assert result["at_start"] is signal.default_int_handler, result
        assert result["caught"].startswith("TrainingInterrupted: training "), result
        assert result["handler"] is signal.default_int_handler


def _wakeup_fd_passed_on() -> dict:
    """A wakeup fd set before fit (asyncio's, another library's) gets every signal byte that
    arrives during fit, and is the wakeup fd again afterwards."""
    theirs, their_writer = socket.socketpair()
    their_writer.setblocking(False)
    theirs.settimeout(10)
    signal.set_wakeup_fd(their_writer.fileno())
    handled: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(signum))
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=1, progress=False)
    calls = {"n": 0}
    during: list[str] = []

    def step_fn(model: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            during.extend(t.name for t in threading.enumerate())
            os.kill(os.getpid(), signal.SIGUSR1)
        return _loss(model, batch)

    _fit(trainer, step_fn)
    after = [t.name for t in threading.enumerate()]
    return {
        "bytes": list(theirs.recv(64)),
        "restored": signal.set_wakeup_fd(-1) == their_writer.fileno(),
        "handled": handled,
        "during": during,
        "after": after,
    }


def test_signals_a_wakeup_fd_set_before_fit_is_passed_on_and_handed_back(run_on_ranks):
    for result in run_on_ranks(_wakeup_fd_passed_on, world_size=2, timeout=120):
        assert "distkit-signals" in result["during"], result  # the watch ran during fit
        assert result["bytes"] == [signal.SIGUSR1], result
        assert result["restored"] and result["handled"] == [signal.SIGUSR1], result
        assert "distkit-signals" not in result["after"], result  # and stopped with it


def _forked_child_signalled(grace: float) -> dict:
    """A process forked during fit (as a DataLoader worker is) inherits the wakeup fd; a
    SIGTERM sent to it alone must not end this rank."""
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=1, progress=False,
                              fault_timeout=grace)  # fmt: skip
    calls = {"n": 0}
    rank = trainer.rank

    def step_fn(model: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2 and rank == 0:
            pid = os.fork()
            if pid == 0:
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(2)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        if calls["n"] == 3:
            time.sleep(grace + 3)  # still in fit well after the child's signal plus the grace
        return _loss(model, batch)

    _fit(trainer, step_fn)
    return {"finished": True}


def test_signals_a_signal_to_a_forked_child_does_not_end_the_rank(run_on_ranks):
    results = run_on_ranks(_forked_child_signalled, 1.0, world_size=2, timeout=120)
    assert results == [{"finished": True}] * 2
