"""Preemption in a user's own loop: ``Runtime(preempt_signals=...)`` and ``rt.preempted()``.

A SIGTERM to one rank inside ``with rt:`` is noted; ``rt.preempted()`` turns True on both ranks
after the same step, the loop saves with ``rt.save`` and ``rt.finish_preemption`` raises
``TrainingPreempted``; the loop started again from that file ends with the weights of the
uninterrupted loop. Real gloo processes.
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import ConfigurationError, TrainingPreempted
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)


def preempt_loop(out: str, signal_at: dict[int, int]) -> dict[str, Any]:
    """Two epochs of 6 steps; rank r signals itself after step signal_at[r] (first run only:
    the file ``signalled`` remembers); resumes from ``ckpt.pt`` when it is there."""
    torch.manual_seed(0)
    path, marker = Path(out) / "ckpt.pt", Path(out) / "signalled"
    with distkit.Runtime("ddp", seed=3, preempt_signals=(signal.SIGTERM,)) as rt:
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(make_dataset(48), batch_size=4, shuffle=True)
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        start = rt.load(path, state)["epoch"] if path.exists() else 0
        steps = 0
        try:
            for epoch in range(start, 2):
                for x, y in loader:
                    rt.backward(nn.functional.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                    steps += 1
                    if signal_at.get(rt.rank) == steps and not marker.exists():
                        if rt.rank == max(signal_at):
                            marker.write_text("1")
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(0.8)  # the peer reads it within two polls (0.4 s)
                    if rt.preempted():
                        rt.save(path, {**state, "epoch": epoch})
                        rt.finish_preemption(path)
        except TrainingPreempted as exc:
            return {"step": exc.step, "code": exc.code, "checkpoint": exc.checkpoint,
                    "message": str(exc)}  # fmt: skip
        return {"state": rt.full_state_dict(model)}


def test_a_user_loop_is_preempted_at_one_step_and_resumes_exactly(run_on_ranks, tmp_path):
    plain = run_on_ranks(partial(preempt_loop, str(tmp_path / "plain"), {}), world_size=2)
    out = tmp_path / "job"
    out.mkdir()
    stopped = run_on_ranks(partial(preempt_loop, str(out), {1: 2}), world_size=2)
    assert stopped[0]["step"] == stopped[1]["step"] >= 2, stopped
    assert stopped[0]["code"] == 143 and stopped[0]["checkpoint"] == str(out / "ckpt.pt")
    # a loop's way back is its own rt.load, not the Trainer's resume= option
    assert "rt.load(path, state)" in stopped[0]["message"]
    assert "resume=" not in stopped[0]["message"]
    resumed = run_on_ranks(partial(preempt_loop, str(out), {1: 2}), world_size=2)
    # the same steps at the same world size, resumed exactly: bitwise (measured 0.0)
    assert max_abs_diff(resumed[0]["state"], plain[0]["state"]) == 0.0


def test_runtime_preemption_needs_the_with_block_and_refuses_a_lone_requeue():
    with pytest.raises(ConfigurationError, match="requeue=True"):
        distkit.Runtime("dp", requeue=True)
    rt = distkit.Runtime("dp", preempt_signals=("TERM",))
    try:
        with pytest.raises(ConfigurationError, match="outside `with rt:`"):
            rt.preempted()
        with rt:
            assert rt.preempted() is False
            with pytest.raises(ConfigurationError, match="before rt"):
                rt.finish_preemption()
    finally:
        rt.close()
    off = distkit.Runtime("dp")
    assert off.preempted() is False  # off: always False, anywhere
    off.close()


def sparse_poll_loop() -> dict[str, str]:
    """Rank 1 asks rt.preempted() only every other step: the ranks reach the agreed step at
    different batches. Rank 0 signals itself after its 2nd step."""
    seen = {"finally": "no"}
    try:
        with distkit.Runtime("ddp", seed=3, preempt_signals=(signal.SIGTERM,)) as rt:
            model = make_mlp()
            model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for step, (x, y) in enumerate(rt.loader(make_dataset(96), batch_size=4), start=1):
                rt.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                if rt.rank == 0 and step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.8)
                if (rt.rank == 0 or step % 2 == 0) and rt.preempted():
                    rt.finish_preemption()
    except BaseException as exc:  # the test reads what each rank raised
        seen["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        seen["finally"] = "yes"
    return seen


def test_a_rank_that_polls_preempted_less_often_fails_every_rank_with_a_distkit_error(
    run_on_ranks,
):
    """Before, rank 0's agreement met rank 1's gradient all-reduce and gloo aborted rank 0 in
    C++ (SIGABRT). Now each rank raises a distkit error and runs its finally blocks."""
    results = run_on_ranks(sparse_poll_loop, world_size=2)
    assert all(r["finally"] == "yes" for r in results), results
    errors = [r.get("error", "") for r in results]
    assert any(e.startswith("RankDisagreementError") for e in errors), errors
    assert all(e.split(":")[0] in ("RankDisagreementError", "PeerFailureError") for e in errors)
    assert all("rt.preempted() exactly once per optimizer step on every rank" in e for e in errors)
