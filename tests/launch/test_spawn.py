"""distkit.spawn: N workers from a script or a notebook, equal to torchrun, errors and Ctrl-C.

Workers are real processes (the "spawn" start method from a script, "fork" from an
interactive ``__main__``), joined by gloo on loopback through a store the caller hosts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import distkit
from distkit.errors import RankDisagreementError, WorkerError
from tests.support.job_scripts.cluster_job import train
from tests.support.paths import ROOT
from tests.support.signals import assert_takes_ctrl_c, ctrl_c_delivered, ctrl_c_ignored
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(300)


def _env() -> dict[str, str]:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _train_and_report(out: str) -> dict:
    train("auto", 4, Path(out))
    return {"pid": os.getpid(), "world_size": torch.distributed.get_world_size()
            if torch.distributed.is_initialized() else None}  # fmt: skip


def test_spawn_equals_torchrun_on_the_same_script(tmp_path):
    by_torchrun, by_spawn = tmp_path / "torchrun", tmp_path / "spawn"
    by_torchrun.mkdir()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", "-m", "tests.support.job_scripts.cluster_job",
                    "auto", "4", str(by_torchrun)], env=_env(), cwd=tmp_path, check=True,
                   capture_output=True, timeout=240)  # fmt: skip
    by_spawn.mkdir()
    result = distkit.spawn(_train_and_report, nprocs=2, args=(str(by_spawn),))
    assert result["pid"] != os.getpid()  # rank 0's value, from a worker
    for rank in range(2):
        mine = torch.load(by_spawn / f"rank{rank}.pt", weights_only=True)
        theirs = torch.load(by_torchrun / f"rank{rank}.pt", weights_only=True)
        assert (mine["strategy"], mine["world_size"]) == ("ddp", 2)
        assert max_abs_diff(mine["state"], theirs["state"]) == 0.0


def _fail_on_rank_one() -> str:
    from torch import nn

    from tests.support.workloads import make_dataset, make_mlp

    def step(model, batch):
        if int(os.environ["RANK"]) == 1:
            raise ValueError("rank one's data is broken")
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    model = make_mlp()
    trainer = distkit.Trainer("auto", batch_size=4, progress=False)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16),
                step_fn=step)  # fmt: skip
    return "finished"


def test_spawn_reraises_the_failing_workers_error_with_its_traceback():
    with pytest.raises(ValueError, match="rank one's data is broken") as info:
        distkit.spawn(_fail_on_rank_one, nprocs=2)
    cause = info.value.__cause__
    assert isinstance(cause, distkit.launch._spawn.RemoteTraceback)
    assert "worker 1" in str(cause) and "in step" in str(cause)  # the worker's own frames


def _fail_on_rank_one_before_its_trainer(stamp: str) -> str:
    """Rank 1 fails at once; rank 0 builds its Trainer and waits for rank 1 to join."""
    from torch import nn

    from tests.support.workloads import make_dataset, make_mlp

    if int(os.environ["RANK"]) == 1:
        Path(stamp).write_text(str(time.time()))
        raise RuntimeError("rank 1 found no data")
    model = make_mlp()
    trainer = distkit.Trainer("auto", batch_size=4, progress=False)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    return "finished"


def test_spawn_a_worker_failing_before_the_others_meet_ends_the_call_within_seconds(tmp_path):
    """Before: rank 0 waited in the rendezvous for rank 1 (30 minutes) and so did the caller
    (here the 120 s timeout= would have raised a WorkerError instead)."""
    stamp = tmp_path / "raised"
    with pytest.raises(RuntimeError, match="rank 1 found no data") as info:
        distkit.spawn(_fail_on_rank_one_before_its_trainer, nprocs=2, args=(str(stamp),),
                      timeout=120)  # fmt: skip
    waited = time.time() - float(stamp.read_text())
    assert waited < distkit.launch._spawn.STOP_AFTER_ERROR_S + 20, f"{waited:.1f}s after the error"
    assert "worker 1" in str(info.value.__cause__)
    assert info.value.__notes__ == [
        "distkit.spawn: worker 0, still running 3s after the first error, was stopped"
    ]


def _fail_on_rank_one_after_its_trainer() -> str:
    """Rank 1 fails between its Trainer and fit; rank 0's fit then finds it gone."""
    from torch import nn

    from tests.support.workloads import make_dataset, make_mlp

    trainer = distkit.Trainer("auto", batch_size=4, progress=False)
    if trainer.rank == 1:
        raise RuntimeError("rank 1 found no data")
    model = make_mlp()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    return "finished"


def test_spawn_two_failed_workers_raise_the_real_error_with_the_follow_on_attached():
    """Rank 0's fit raises RankDisagreementError because rank 1 went away: a follow-on.
    Before, the caller raised it (the lower rank) and dropped rank 1's RuntimeError."""
    with pytest.raises(RuntimeError, match="rank 1 found no data") as info:
        distkit.spawn(_fail_on_rank_one_after_its_trainer, nprocs=2, timeout=120)
    assert not isinstance(info.value, RankDisagreementError)
    (note,) = info.value.__notes__
    follow_on = "distkit.spawn: worker 0 failed too: RankDisagreementError: rank 0 waited"
    assert note.startswith(follow_on) or "worker 0, still running" in note, note


class Unpicklable(Exception):
    def __init__(self, handle: object) -> None:
        super().__init__("with a handle")
        self.handle = handle

    def __reduce__(self):
        raise TypeError("cannot pickle a handle")


def _raise_unpicklable() -> None:
    raise Unpicklable(object())


def test_spawn_an_error_that_cannot_travel_is_a_worker_error():
    with pytest.raises(WorkerError, match="worker 0 raised Unpicklable: with a handle"):
        distkit.spawn(_raise_unpicklable, nprocs=1)


def _exit_hard() -> None:
    os._exit(3)


def test_spawn_a_worker_that_dies_silently_is_reported():
    with pytest.raises(WorkerError, match="exit code 3 without reporting"):
        distkit.spawn(_exit_hard, nprocs=1)


def test_spawn_from_an_interactive_main_forks(tmp_path):
    """As in a notebook: fn defined in a __main__ without a file (python -c)."""
    code = textwrap.dedent('''
        import distkit, torch
        def fn(scale):
            torch.distributed.init_process_group("gloo")
            value = torch.tensor([float(torch.distributed.get_rank() + 1)])
            torch.distributed.all_reduce(value)
            torch.distributed.destroy_process_group()
            return value.item() * scale
        print("RESULT", distkit.spawn(fn, nprocs=2, args=(10,)))
    ''')  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT 30.0" in done.stdout


def test_spawn_ctrl_c_leaves_no_worker_behind(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f'''
        import os, time, distkit
        def fn():
            open(os.path.join({str(tmp_path)!r}, f"pid{{os.environ['RANK']}}"), "w").write(
                str(os.getpid()))
            while True:
                time.sleep(0.1)
        if __name__ == "__main__":
            distkit.spawn(fn, nprocs=2)
    '''))  # fmt: skip
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen([sys.executable, str(script)], env=_env(), cwd=tmp_path, **pipe,
                            **ctrl_c_delivered())  # fmt: skip
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in pid_files]
    assert_takes_ctrl_c(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in out
    for pid in pids:  # the workers are gone (not zombies of a live parent either)
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived Ctrl-C"


def _hello() -> str:
    return "hello"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"nprocs": 0}, "nprocs must be an integer >= 1"),
        ({"nprocs": 2, "args": [1]}, "args must be a tuple"),
        ({"nprocs": 1, "start_method": "thread"}, "allowed: fork, spawn, forkserver"),
    ],
)
def test_spawn_bad_arguments_say_the_fix(kwargs, words):
    with pytest.raises(distkit.ConfigurationError, match=words):
        distkit.spawn(_hello, **kwargs)


def test_spawn_refuses_to_fork_after_cuda_was_initialised(monkeypatch):
    """FAKE CUDA (there is none here): torch.cuda reports an initialised GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(distkit.ConfigurationError, match="CUDA was initialised in this process"):
        distkit.spawn(_hello, nprocs=1, start_method="fork")


def test_spawn_returns_rank_zeros_value():
    assert distkit.spawn(_hello, nprocs=1) == "hello"


def test_spawn_started_with_sigint_ignored_keeps_it_ignored_in_every_worker(tmp_path):
    """`nohup`, `cmd &` in a script, a CI agent: the caller ignores SIGINT, as the user asked,
    and so does every worker, whichever the start method (docs/clusters.md: Ctrl-C is off for
    such a job; SIGTERM stops it)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent('''
        import signal, distkit
        def fn():
            return signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        if __name__ == "__main__":
            for method in ("fork", "spawn", "forkserver"):
                print(method, distkit.spawn(fn, nprocs=2, start_method=method), flush=True)
    '''))  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], env=_env(), cwd=tmp_path, text=True,
                          capture_output=True, timeout=180, **ctrl_c_ignored())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["fork", "True", "spawn", "True", "forkserver", "True"]
