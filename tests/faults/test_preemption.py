"""Preemption: a scheduler's signal stops every rank after the same step, with the run saved.

Each job (``tests/support/job_scripts/preempt_job.py``) is stopped by a signal (to one rank,
or to every rank at a different step, from inside at a step chosen by a seeded RNG, or from
outside at a random time), exits with 128 + the signal's number, and is started again with
``resume="auto"``; it must end with the weights of the same job run without interruption.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

import distkit
from distkit import checkpoint as ckpt
from distkit.errors import ConfigurationError, TrainingPreempted
from distkit.faults._preempt import DEFAULT_SIGNALS
from distkit.launch._requeue import slurm_job_id
from tests.support.exactness import TOL
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.jobs import run_job
from tests.support.paths import ROOT
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
PYTHON = [sys.executable]
SCRIPT = ["-m", "tests.support.job_scripts.preempt_job"]
#: steps of an uninterrupted job: 96 samples, 2 epochs, batch 4 per rank (x2 ranks)
STEPS_X2 = 24
TIMELINE = "distkit: preempted: "


def _horovodrun() -> list[str]:
    return [str(horovodrun_path()), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        if key not in extra:
            env.pop(key, None)
    return env


def _run(launcher: list[str], strategy: str, out: Path, *args: str, env=None):
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*launcher, *SCRIPT, strategy, str(out), *args]
    return run_job(cmd, env=env or _env(), timeout=180, cwd=ROOT)


def _reference(tmp_path_factory, launcher: list[str], strategy: str, *args: str) -> dict:
    """The job's final weights, uninterrupted (once per launcher and strategy per worker).

    For this job, 2 ranks of ddp, fsdp (sharded checkpoints) and horovod end with bitwise the
    same weights (checked when these tests were written: largest difference 0.0), so the
    torchrun ddp run is the uninterrupted reference of all three."""
    key = "-".join([Path(launcher[0]).name, strategy, *args]).replace("/", "_")
    out = tmp_path_factory.getbasetemp() / f"preempt-ref-{key}"
    if not (out / "final.pt").exists():
        proc = _run(launcher, strategy, out, *args)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return torch.load(out / "final.pt")


def _preempted(out: Path, ranks: int) -> list[dict]:
    return [json.loads((out / f"preempted-{r}.json").read_text()) for r in range(ranks)]


def _check_preempted(proc, out: Path, ranks: int, signum: int) -> int:
    """The job stopped for ``signum``: every rank after the same step, saved there; returns
    the step."""
    output = proc.stdout + proc.stderr
    said = _preempted(out, ranks)
    assert len({s["step"] for s in said}) == 1, said
    step = said[0]["step"]
    assert all(s["code"] == 128 + signum and s["signal"] == signum for s in said), said
    checkpoint = Path(said[0]["ckpt"])
    assert checkpoint.exists() and checkpoint.name == f"step-{step:09d}.pt", said
    assert output.count(TIMELINE) == 1, output[-4000:]  # rank 0 says it, once
    assert f"stopped after step {step}" in output
    return step


def _resume_matches(launcher, strategy, out, reference, *args) -> None:
    proc = _run(launcher, strategy, out, *args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert max_abs_diff(torch.load(out / "final.pt"), reference) <= TOL  # the job is float64


# ---------------------------------------------------------------------------- arguments
def test_preempt_signals_default_to_sigterm_and_sigusr1_with_a_checkpoint_dir(tmp_path):
    assert distkit.Trainer(checkpoint_dir=tmp_path).config.preempt == DEFAULT_SIGNALS
    assert distkit.Trainer().config.preempt == ()  # nothing to save into: off
    off = distkit.Trainer(checkpoint_dir=tmp_path, preempt_signals=())
    assert off.config.preempt == ()
    named = distkit.Trainer(checkpoint_dir=tmp_path, preempt_signals=("USR2", 15, signal.SIGTERM))
    assert named.config.preempt == (signal.SIGUSR2, signal.SIGTERM)
    one = distkit.Trainer(checkpoint_dir=tmp_path, preempt_signals=signal.SIGUSR1)
    assert one.config.preempt == (signal.SIGUSR1,)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"preempt_signals": (signal.SIGTERM,)}, "needs checkpoint_dir"),
        ({"requeue": True}, "requeue=True asks SLURM"),
        ({"checkpoint_dir": "x", "preempt_signals": (), "requeue": True}, "requeue=True"),
        ({"checkpoint_dir": "x", "requeue": "yes"}, "requeue"),
        ({"checkpoint_dir": "x", "preempt_signals": (signal.SIGKILL,)}, "cannot be caught"),
        ({"checkpoint_dir": "x", "preempt_signals": ("SIGFOO",)}, "is not a signal"),
        ({"checkpoint_dir": "x", "preempt_signals": (2.5,)}, "is not a signal"),
        ({"checkpoint_dir": "x", "preempt_signals": 2.5}, "got float"),
        ({"checkpoint_dir": "x", "preempt_signals": ("INT",)}, "Ctrl-C"),
    ],
)
def test_preempt_arguments_that_cannot_work_are_refused_at_construction(kwargs, says):
    with pytest.raises(ConfigurationError, match=says):
        distkit.Trainer(**kwargs)


def test_slurm_job_id_names_the_array_task():
    assert slurm_job_id({"SLURM_JOB_ID": "7"}) == "7"
    array = {"SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm_job_id({"SLURM_JOB_ID": "9", **array}) == "8_3"
    assert slurm_job_id({}) is None


# ---------------------------------------------------------------------------- one process
def _stand_in_scontrol(folder: Path) -> tuple[dict[str, str], Path]:
    """An ``scontrol`` on PATH that appends its arguments to a file: (env, that file)."""
    record = folder / "scontrol-calls"
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    scontrol.chmod(0o755)
    env = _env(SLURM_JOB_ID="4242", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return env, record


def test_preempt_one_process_saves_runs_the_users_handler_requeues_and_resumes_exactly(
    tmp_path, tmp_path_factory
):
    reference = _reference(tmp_path_factory, PYTHON, "auto")
    out = tmp_path / "job"
    env, record = _stand_in_scontrol(tmp_path)
    args = ["--signal-at", "0:29", "--user-handler", "--second-signal", "--requeue"]
    proc = _run(PYTHON, "auto", out, *args, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 143, output[-4000:]
    assert _check_preempted(proc, out, 1, signal.SIGTERM) == 29
    # the signal that came during the save changed nothing; the user's handler ran after it
    assert "1 more signal(s) during the stop were ignored" in output
    assert (out / "user-handler-0").read_text() == str(int(signal.SIGTERM))
    assert record.read_text().split() == ["requeue", "4242"]
    assert "requeued SLURM job 4242" in output
    assert "Traceback" not in output
    _resume_matches(PYTHON, "auto", out, reference)


# ---------------------------------------------------------------------------- two ranks
def _steps(seed: int, ranks: list[int]) -> list[str]:
    """``--signal-at`` for each rank, at a step the seeded RNG picks. A rank that got no signal
    learns of it from the side channel within two polls (0.4 s); the signalled rank waits that
    long (preempt_job), so none reaches the end of training first (it would end as trained)."""
    rng = random.Random(seed)
    return [arg for r in ranks for arg in ("--signal-at", f"{r}:{rng.randint(2, 10)}")]


CASES = [pytest.param([1], 11, id="one-rank"), pytest.param([0, 1], 12, id="every-rank")]
#: DataLoader workers, and the signal to the rank's whole process group (as torchrun and
#: schedulers send it): the workers must outlive it until the run is saved
WORKERS = ["--num-workers", "2", "--group"]


@pytest.mark.parametrize(("ranks", "seed"), CASES)
def test_preempt_torchrun_ddp_stops_every_rank_at_one_step_and_resumes_exactly(
    tmp_path, tmp_path_factory, ranks, seed
):
    reference = _reference(tmp_path_factory, TORCHRUN, "ddp")
    out = tmp_path / "job"
    env, record = _stand_in_scontrol(tmp_path)
    workers = WORKERS if len(ranks) == 1 else []
    proc = _run(TORCHRUN, "ddp", out, *_steps(seed, ranks), *workers, "--requeue", env=env)
    assert proc.returncode != 0
    step = _check_preempted(proc, out, 2, signal.SIGTERM)
    first = min(int(a.split(":")[1]) for a in _steps(seed, ranks) if ":" in a)
    assert first <= step < STEPS_X2
    assert record.read_text().splitlines() == ["requeue 4242"]  # rank 0 only, once
    _resume_matches(TORCHRUN, "ddp", out, reference)


def test_preempt_during_background_saves_finishes_them_and_resumes_exactly(
    tmp_path, tmp_path_factory
):
    """checkpoint_async=True, a checkpoint every 2 steps: SIGTERM to rank 1 after step 5 (the
    step-4 checkpoint may still be persisting). The preemption's checkpoint waits for it,
    fit waits for both: every rank stops after one step with a complete checkpoint there,
    and the rerun ends where the uninterrupted job ends."""
    reference = _reference(tmp_path_factory, TORCHRUN, "ddp")
    out = tmp_path / "job"
    proc = _run(TORCHRUN, "ddp", out, "--signal-at", "1:5", "--async-every", "2")
    assert proc.returncode != 0
    step = _check_preempted(proc, out, 2, signal.SIGTERM)
    assert not list((out / "ckpt").glob(".*.tmp")), list((out / "ckpt").iterdir())
    assert ckpt.load(out / "ckpt" / f"step-{step:09d}.pt")["progress"]["global_step"] == step
    _resume_matches(TORCHRUN, "ddp", out, reference, "--async-every", "2")


@needs("horovod")
@pytest.mark.parametrize(("ranks", "seed"), CASES)
def test_preempt_horovodrun_stops_every_rank_at_one_step_and_resumes_exactly(
    tmp_path, tmp_path_factory, ranks, seed
):
    reference = _reference(tmp_path_factory, TORCHRUN, "ddp")  # the same weights: see _reference
    out = tmp_path / "job"
    proc = _run(_horovodrun(), "horovod", out, *_steps(seed, ranks))
    assert proc.returncode != 0
    _check_preempted(proc, out, 2, signal.SIGTERM)
    _resume_matches(_horovodrun(), "horovod", out, reference)


def test_preempt_fsdp_sharded_checkpoint_on_sigusr1_resumes_exactly(tmp_path, tmp_path_factory):
    reference = _reference(tmp_path_factory, TORCHRUN, "ddp")  # the same weights: see _reference
    out = tmp_path / "job"
    proc = _run(TORCHRUN, "fsdp", out, "--sharded", "--send", "USR1", *_steps(5, [0, 1]), *WORKERS)
    step = _check_preempted(proc, out, 2, signal.SIGUSR1)
    assert list((out / "ckpt").glob(f"step-{step:09d}.pt.*.shards"))  # DCP shards, per rank
    _resume_matches(TORCHRUN, "fsdp", out, reference, "--sharded")


def test_preempt_signal_sent_from_outside_at_a_random_time_to_every_rank(
    tmp_path, tmp_path_factory
):
    """As a scheduler does it: SIGTERM to every rank's process, at a moment of its own."""
    reference = _reference(tmp_path_factory, TORCHRUN, "ddp")
    out = tmp_path / "job"
    out.mkdir()
    cmd = [*TORCHRUN, *SCRIPT, "ddp", str(out), "--step-sleep", "0.05"]
    job = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = _wait_for_pids(out, 2, job)
        time.sleep(random.Random(3).uniform(0.1, 0.4))  # into training (24 steps of 50 ms+)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        job.communicate(timeout=120)
    finally:
        job.kill()
    said = _preempted(out, 2)
    assert said[0]["step"] == said[1]["step"] < STEPS_X2, said
    _resume_matches(TORCHRUN, "ddp", out, reference)


def _wait_for_pids(out: Path, ranks: int, job: subprocess.Popen) -> list[int]:
    files = [out / f"started-{r}" for r in range(ranks)]
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in files):
        assert job.poll() is None and time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


# ---------------------------------------------------------------------------- in-process
class _SignalAt3(distkit.Callback):
    """Rank 0 sends itself SIGTERM after step 3, then waits: its request is posted within one
    poll (0.2 s) and a peer reads it within the next, before the 5 steps left run out."""

    def on_train_step_end(self, trainer, logs):
        if logs["step"] == 3 and trainer.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.8)


def _fit_to_the_signal(trainer: distkit.Trainer) -> dict:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        trainer.fit(model, optimizer, make_dataset(64), torch.nn.functional.cross_entropy)
    except TrainingPreempted as exc:
        return {"raised": "TrainingPreempted", "step": exc.step, "code": exc.code}
    except BaseException as exc:
        return {"raised": type(exc).__name__, "text": str(exc)[:300]}
    return {"raised": None}


def fit_inside_a_runtime_block(out: str) -> dict:
    """A Trainer's fit inside ``with Runtime(...)`` (no preemption of its own): the outer
    guard's SIGTERM handler is distkit's, not the user's, and must not run after the save."""
    with distkit.Runtime("ddp") as rt:
        trainer = distkit.Trainer(runtime=rt, batch_size=4, progress=False,
                                  checkpoint_dir=out, callbacks=[_SignalAt3()])  # fmt: skip
        return _fit_to_the_signal(trainer)


def fit_with_a_raising_handler(out: str) -> dict:
    """The user's own SIGTERM handler raises: the requeue happens all the same."""

    def handler(signum, frame):
        raise RuntimeError("the user's handler failed")

    signal.signal(signal.SIGTERM, handler)
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, checkpoint_dir=out,
                              requeue=True, callbacks=[_SignalAt3()])  # fmt: skip
    return _fit_to_the_signal(trainer)


def test_preempt_inside_a_runtime_block_raises_training_preempted_on_every_rank(
    run_on_ranks, tmp_path
):
    said = run_on_ranks(partial(fit_inside_a_runtime_block, str(tmp_path)), world_size=2)
    assert [s["raised"] for s in said] == ["TrainingPreempted"] * 2, said
    assert said[0]["step"] == said[1]["step"] and said[0]["code"] == 143
    assert (tmp_path / f"step-{said[0]['step']:09d}.pt").exists()


def test_preempt_requeues_even_when_the_users_handler_raises(run_on_ranks, tmp_path):
    env, record = _stand_in_scontrol(tmp_path)
    run = partial(run_on_ranks, world_size=1, env=env)
    said = run(partial(fit_with_a_raising_handler, str(tmp_path / "ckpt")))[0]
    assert said == {"raised": "RuntimeError", "text": "the user's handler failed"}
    assert record.read_text().split() == ["requeue", "4242"]
    assert (tmp_path / "ckpt" / "step-000000003.pt").exists()  # saved before the handler ran


def fit_signalled_while_blocked(out: str) -> dict:
    """Rank 1 gets SIGTERM while its main thread waits in an all-reduce for rank 0, which
    spends 4 s in its forward: longer than the 2 s grace after which a plain SIGTERM ends a
    blocked rank. A preempting one must wait, and the job stop and save as usual."""
    import threading

    class Slow(distkit.Callback):
        def on_train_step_end(self, trainer, logs):
            if logs["step"] == 2 and trainer.rank == 1:  # delivered once blocked in step 3
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()

    def step_fn(model, batch):
        if trainer.rank == 0 and trainer.global_step == 2:
            time.sleep(4.0)
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    trainer = distkit.Trainer("ddp", batch_size=4, progress=False, checkpoint_dir=out,
                              fault_timeout=2.0, callbacks=[Slow()])  # fmt: skip
    model = make_mlp()
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(64),
                    step_fn=step_fn)  # fmt: skip
    except TrainingPreempted as exc:
        return {"raised": "TrainingPreempted", "step": exc.step}
    except BaseException as exc:
        return {"raised": type(exc).__name__, "text": str(exc)[:300]}
    return {"raised": None}


def test_preempt_waits_for_a_rank_blocked_in_a_collective_past_the_grace(run_on_ranks, tmp_path):
    said = run_on_ranks(partial(fit_signalled_while_blocked, str(tmp_path)), world_size=2)
    assert [s["raised"] for s in said] == ["TrainingPreempted"] * 2, said
    assert said[0]["step"] == said[1]["step"] >= 3


def sigterm_stops_and_resumes_exactly(strategy: str, tmp_path: Path, *, sharded: bool) -> None:
    """torchrun x2 under ``strategy`` (a preempt_job layout: "tp2", "pp2"): SIGTERM to rank 1
    at a step stops both ranks after the same step with a checkpoint; the rerun resumes and
    ends where the uninterrupted job ends."""
    flags = ["--sharded"] if sharded else []
    whole = _run(TORCHRUN, strategy, tmp_path / "whole", *flags)
    assert whole.returncode == 0, (whole.stdout + whole.stderr)[-4000:]
    out = tmp_path / "job"
    proc = _run(TORCHRUN, strategy, out, *_steps(3, [1]), *flags)
    assert proc.returncode != 0
    _check_preempted(proc, out, 2, signal.SIGTERM)
    again = _run(TORCHRUN, strategy, out, *flags)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    reference = torch.load(tmp_path / "whole" / "final.pt")
    assert max_abs_diff(torch.load(out / "final.pt"), reference) <= TOL
