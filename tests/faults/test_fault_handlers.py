"""A multi-process failure runs the user's own handlers, Ctrl-C stops a job in one line, a stuck
rank is named, and the collective timeout is the Trainer's to set. Real launchers and processes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import ConfigurationError, PeerFailureError
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.multiprocess import free_port, torchrun_env
from tests.support.paths import ROOT
from tests.support.signals import assert_takes_ctrl_c, ctrl_c_delivered, ctrl_c_ignored
from tests.support.workloads import make_dataset

pytestmark = pytest.mark.timeout(300)

JOB = str(ROOT / "tests" / "support" / "job_scripts" / "handlers_job.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
NEEDS_HOROVOD = needs("horovod")


def _horovodrun() -> list[str]:
    return [str(horovodrun_path()), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _strip_prefixes(output: str) -> list[str]:
    prefix = r"^(?:\[\d+\]<std(?:out|err)>:|\[rank\d+\]: )"
    return [re.sub(prefix, "", line) for line in output.splitlines()]


def _run_job(
    launcher: list[str], out: Path, *args: str
) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [*launcher, JOB, args[0], str(out), *args[1:]],
        capture_output=True, text=True, env=_env(), timeout=180,
    )  # fmt: skip
    return proc, time.monotonic() - start


def _read(out: Path, name: str) -> str:
    path = out / name
    return path.read_text() if path.exists() else f"<{name} missing>"


@pytest.mark.parametrize(
    "launcher",
    [pytest.param("torchrun", id="ddp-torchrun"), pytest.param("horovodrun", id="horovod",
                                                                marks=NEEDS_HOROVOD)],
)  # fmt: skip
def test_fault_handlers_user_except_and_finally_run_on_every_rank(tmp_path, launcher):
    command, strategy = (TORCHRUN, "ddp") if launcher == "torchrun" else (_horovodrun(), "horovod")
    proc, seconds = _run_job(command, tmp_path, strategy, "raise")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 60, output[-3000:]
    # the failing rank's own error reaches its handler, unchanged
    assert _read(tmp_path, "except_1") == "ValueError: boom at step 3", output[-3000:]
    # its peer's handler sees a PeerFailureError naming rank 1 and the error
    peer = _read(tmp_path, "except_0")
    assert peer.startswith("PeerFailureError: rank 0 stopped because rank 1 failed"), peer
    assert "ValueError: boom at step 3" in peer
    assert (tmp_path / "finally_0").exists() and (tmp_path / "finally_1").exists()
    lines = _strip_prefixes(output)
    assert sum(line.startswith("ValueError: boom") for line in lines) == 1, output[-4000:]


def _peer_failure_on_rank(fail_rank: int) -> dict:
    """Rank ``fail_rank`` raises in step 2; returns what each rank's own handlers saw."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=2, progress=False)
    calls = {"n": 0}

    def step_fn(m: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        if trainer.rank == fail_rank and calls["n"] == 2:
            raise KeyError("missing column 'label'")
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    seen: dict = {"rank": trainer.rank}
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(40),
                    step_fn=step_fn)  # fmt: skip
    except PeerFailureError as exc:
        seen.update(kind="peer", failed_rank=exc.failed_rank, reason=exc.reason, text=str(exc))
    except KeyError as exc:
        seen.update(kind="own", text=str(exc))
    finally:
        seen["closed"] = not torch.distributed.is_initialized() and trainer.closed
        seen["is_main"] = trainer.is_main  # handlers still know who they are
    return seen


def test_fault_handlers_peer_failure_error_names_the_failed_rank_and_its_error(run_on_ranks):
    # rank 0 fails and hosts the store (no agent): its peers must still read its notice
    own, peer = run_on_ranks(_peer_failure_on_rank, 0, world_size=2, timeout=90, agent_store=False)
    assert own["kind"] == "own" and "missing column" in own["text"]
    assert peer["kind"] == "peer", peer
    assert peer["failed_rank"] == 0
    assert peer["reason"] == "KeyError: \"missing column 'label'\"", peer
    assert "rank 1 stopped because rank 0 failed" in peer["text"]
    # both trainers released their process group before the handlers ran
    assert own["closed"] and peer["closed"]
    assert own["is_main"] and not peer["is_main"]


@pytest.mark.parametrize(
    "launcher",
    [pytest.param("torchrun", id="ddp-torchrun"), pytest.param("horovodrun", id="horovod",
                                                                marks=NEEDS_HOROVOD)],
)  # fmt: skip
def test_fault_handlers_a_rank_sleeping_in_step_fn_is_named_by_rank_0(tmp_path, launcher):
    command, strategy = (TORCHRUN, "ddp") if launcher == "torchrun" else (_horovodrun(), "horovod")
    # hang_warning=2 s in the job; rank 1 sleeps 8 s at step 3, then the job finishes normally
    proc, _ = _run_job(command, tmp_path, strategy, "sleep", "--seconds", "8")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    warnings = [line for line in _strip_prefixes(output) if "has made no progress" in line]
    assert len(warnings) == 1, output[-4000:]  # once per stall, by rank 0 only
    assert warnings[0].startswith("distkit: rank 1 has made no progress for ")
    assert "epoch 1, step 3 (forward)" in warnings[0]
    assert "time.sleep(args.seconds)" in output  # the stuck rank's stack
    seconds = float(re.search(r"no progress for (\d+)s", warnings[0]).group(1))
    assert 2 <= seconds <= 5  # named within the threshold plus one poll, not after the sleep


def _wait_for(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never started: {paths}"
        time.sleep(0.1)


def test_fault_handlers_ctrl_c_under_torchrun_prints_one_line_and_runs_handlers(tmp_path):
    proc = subprocess.Popen(
        [*TORCHRUN, JOB, "ddp", str(tmp_path), "wait"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True,
        **ctrl_c_delivered(),
    )  # fmt: skip
    try:
        _wait_for([tmp_path / "started_0", tmp_path / "started_1"], 90)
        assert_takes_ctrl_c(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does to the job
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = _strip_prefixes(output)
    ours = [line for line in lines if "interrupted (Ctrl-C)" in line]
    assert len(ours) == 1, output[-4000:]
    assert re.match(r"distkit: rank \d interrupted \(Ctrl-C\) in epoch \d+, step \d+;", ours[0])
    # no worker prints a traceback (torchrun's agent prints its own SignalException)
    assert not any(line.startswith("[rank") and "Traceback" in line for line in output.splitlines())
    assert "KeyboardInterrupt" not in output
    for rank in (0, 1):
        assert _read(tmp_path, f"except_{rank}").startswith("TrainingInterrupted: training "
                                                            "interrupted (Ctrl-C)")  # fmt: skip
        assert (tmp_path / f"finally_{rank}").exists()
    assert proc.returncode != 0


def test_fault_handlers_ctrl_c_workers_exit_130_without_a_traceback(tmp_path):
    """The workers' own exit status, launched with torchrun's variables but no agent."""
    port = free_port()
    env = _env()
    procs = [
        subprocess.Popen(
            [sys.executable, JOB, "ddp", str(tmp_path), "wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, **torchrun_env(rank, 2, port)},
            start_new_session=True,
            **ctrl_c_delivered(),
        )
        for rank in (0, 1)
    ]
    try:
        _wait_for([tmp_path / "started_0", tmp_path / "started_1"], 90)
        for p in procs:
            assert_takes_ctrl_c(p.pid)
            p.send_signal(signal.SIGINT)
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [130, 130], outputs
    joined = "".join(outputs)
    assert "Traceback" not in joined, joined[-3000:]
    assert sum("interrupted (Ctrl-C)" in line for line in joined.splitlines()) == 1, joined


def test_fault_handlers_ctrl_c_in_one_process_exits_130_in_one_line(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(
        "import os, signal, torch, distkit\n"
        "from torch import nn\n"
        "from tests.support.workloads import make_dataset\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C on\n"
        "t = distkit.Trainer('ddp', batch_size=4, max_epochs=3, progress=False)\n"
        "m = nn.Linear(6, 3)\n"
        "def step(model, batch):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    x, y = batch\n"
        "    return nn.functional.cross_entropy(model(x), y)\n"
        "try:\n"
        "    t.fit(m, torch.optim.SGD(m.parameters(), lr=0.1), make_dataset(16), step_fn=step)\n"
        "finally:\n"
        "    print('finally ran', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=_env(), timeout=120, **ctrl_c_delivered())  # fmt: skip
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "finally ran" in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "distkit: rank 0 interrupted (Ctrl-C) in epoch 1, step 1; stopping every rank"
    ], proc.stderr


def test_fault_handlers_a_job_started_with_sigint_ignored_trains_through_ctrl_c(tmp_path):
    """SIGINT ignored when the job starts (`nohup`, `cmd &` in a script): the user turned
    Ctrl-C off, and distkit keeps it off (docs/faults.md); the fit ends as trained."""
    script = tmp_path / "one.py"
    script.write_text(
        "import os, signal, torch, distkit\n"
        "from torch import nn\n"
        "from tests.support.workloads import make_dataset\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "t = distkit.Trainer('ddp', batch_size=4, max_epochs=2, progress=False)\n"
        "m = nn.Linear(6, 3)\n"
        "def step(model, batch):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    x, y = batch\n"
        "    return nn.functional.cross_entropy(model(x), y)\n"
        "t.fit(m, torch.optim.SGD(m.parameters(), lr=0.1), make_dataset(16), step_fn=step)\n"
        "print('trained', t.global_step, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=_env(), timeout=120, **ctrl_c_ignored())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["trained", "8", "True"], proc.stdout
    assert "interrupted" not in proc.stderr, proc.stderr


def _collective_timeout_on_rank(
    folder: str, hang_warning: float | None = None, at: int = 2
) -> dict:
    """Rank 1 sleeps 12 s in step ``at``; rank 0's collective must give up after 3 s."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    trainer = distkit.Trainer(
        "ddp", batch_size=4, max_epochs=1, progress=False, collective_timeout=3,
        fault_timeout=None, hang_warning=hang_warning,
    )  # fmt: skip
    calls = {"n": 0}
    rank = trainer.rank

    def step_fn(m: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        if rank == 1 and calls["n"] == at:
            time.sleep(12)
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    start = time.monotonic()
    stuck_ranks = None
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(24),
                    step_fn=step_fn)  # fmt: skip
        outcome = "finished"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
        stuck_ranks = getattr(exc, "stuck_ranks", None)
    seconds = time.monotonic() - start
    marker = Path(folder) / "rank_1_done"
    if rank == 1:
        marker.write_text("1")
    else:  # rank 0 hosts the rendezvous store here: stay until rank 1 has read the notice
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return {"seconds": seconds, "outcome": outcome, "stuck_ranks": stuck_ranks}


def test_fault_handlers_collective_timeout_bounds_the_wait_for_a_stuck_rank(run_on_ranks, tmp_path):
    waiting, stuck = run_on_ranks(
        _collective_timeout_on_rank, str(tmp_path), world_size=2, timeout=120
    )
    assert "timed out" in waiting["outcome"].lower() or "timeout" in waiting["outcome"].lower(), (
        waiting
    )
    # hang_warning=None: no rank publishes its progress, so the backend's error is all there is
    assert waiting["outcome"].startswith("RuntimeError: "), waiting
    assert waiting["seconds"] < 10, waiting
    assert stuck["outcome"].startswith("PeerFailureError: rank 1 stopped because rank 0 failed")


@pytest.mark.parametrize(
    ("at", "waiting_in"),
    [
        # step 2: DDP's forward re-broadcasts its buckets, so rank 0 waits in the same phase
        # as the sleeper: its stack tells them apart
        pytest.param(2, r"step 2 \((forward|backward)\)", id="same-phase"),
        # step 3: rank 0 waits in backward's all-reduce, behind it the sleeper's forward
        pytest.param(3, r"step 3 \(backward\)", id="behind"),
    ],
)
def test_fault_handlers_collective_timeout_names_the_stuck_rank_and_where_it_was(
    run_on_ranks, tmp_path, at, waiting_in
):
    waiting, stuck = run_on_ranks(
        _collective_timeout_on_rank, str(tmp_path), 1.0, at, world_size=2, timeout=120
    )
    outcome = waiting["outcome"]
    assert re.match(
        rf"PeerStuckError: rank 0 timed out in a collective in epoch 1, {waiting_in}, waiting "
        rf"for rank 1: rank 1 was last seen in epoch 1, step {at} \(forward\), at ",
        outcome,
    ), waiting
    assert "in step_fn: time.sleep(12)" in outcome, outcome  # its innermost frame
    assert "The backend said: RuntimeError: " in outcome and "Timed out" in outcome, outcome
    assert waiting["stuck_ranks"] == (1,)
    assert waiting["seconds"] < 30, waiting  # the timeout ended it (rank 1 never came)
    # the stuck rank, once it wakes, is told why the others stopped
    assert stuck["outcome"].startswith(
        "PeerFailureError: rank 1 stopped because rank 0 failed: PeerStuckError: rank 0 timed "
        "out in a collective"
    ), stuck


def test_fault_handlers_collective_timeout_given_twice_must_agree():
    strategy = distkit.DDPStrategy(timeout=60)
    trainer = distkit.Trainer(strategy, collective_timeout=60, progress=False)
    trainer.close()
    with pytest.raises(ConfigurationError, match="give it in one place only"):
        distkit.Trainer(distkit.DDPStrategy(timeout=30), collective_timeout=60)


@pytest.mark.parametrize("name", ["hang_warning", "collective_timeout", "fault_timeout"])
@pytest.mark.parametrize("value", [0, -1, "5", True, float("nan")])
def test_fault_handlers_durations_must_be_positive_seconds(name, value):
    with pytest.raises(ConfigurationError, match=f"{name} must be a positive number of seconds"):
        distkit.Trainer("dp", **{name: value})


def test_fault_handlers_horovod_refuses_a_collective_timeout_it_cannot_keep():
    pytest.importorskip("horovod.torch", reason="needs a Horovod build")
    from distkit.errors import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError, match="Horovod has no per-collective timeout"):
        distkit.Trainer("horovod", collective_timeout=30)


def test_fault_handlers_sigterm_to_one_worker_runs_every_rank_handlers(tmp_path):
    """SIGTERM (a launcher stopping a worker, a scheduler pre-empting it) becomes an exception."""
    port = free_port()
    env = _env()
    procs = [
        subprocess.Popen(
            [sys.executable, JOB, "ddp", str(tmp_path), "wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, **torchrun_env(rank, 2, port)},
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        _wait_for([tmp_path / "started_0", tmp_path / "started_1"], 90)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [143, 143], outputs
    joined = "".join(outputs)
    assert "Traceback" not in joined, joined[-3000:]
    assert sum("terminated (SIGTERM)" in line for line in joined.splitlines()) == 1, joined
    assert _read(tmp_path, "except_1").startswith("TrainingInterrupted: training terminated")
    assert _read(tmp_path, "except_0").startswith("TrainingInterrupted: training stopped: rank 1")
    assert (tmp_path / "finally_0").exists() and (tmp_path / "finally_1").exists()
