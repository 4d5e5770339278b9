"""The Runtime as a drop-in (issue 44) on one CUDA GPU, in one process (issue 50).

What ``rt.setup`` and ``rt.loader`` hand back, used as torch's own objects in a hand-written
loop on the GPU: issue 44's hand loop (``LambdaLR`` on the set-up optimizer, a write to its
``defaults``, ``loader.sampler.set_epoch``, ``torch.load`` of ``rt.save``'s file) against the
same loop on the CPU; a user's own ``torch.optim.AdamW`` subclass (its ``step`` override called
once per step, its moments on the GPU) driven by ``LambdaLR`` with accumulation, against plain
torch on the same GPU; and the loop's steady steps under
``torch.cuda.set_sync_debug_mode("error")``. In float64, where the same arithmetic in another
order differs by ~1e-16 per step (tests/support/exactness.py). Every test needs a CUDA GPU and
skips without one (CI has none); ``scripts/gpu_check.sh`` runs them in its focus step, and
docs/gpu.md records their runs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import distkit
from tests.runtime.test_drop_in import hand_loop
from tests.support import exactness
from tests.support.gates import needs
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = [needs("cuda"), pytest.mark.timeout(300)]
STRATEGIES = ["dp", "ddp", "fsdp"]
SAMPLES, BATCH, ACCUM, EPOCHS = 29, 4, 2, 2  # windows of 8, 8, 8, 5 samples an epoch


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_hand_loop_runs_unchanged_and_ends_where_it_ends_on_the_cpu(
    run_on_ranks, strategy, tmp_path
):
    on_gpu = hand_loop(strategy, str(tmp_path / "gpu"))
    # the same loop in a process that sees no GPU: the CPU reference
    on_cpu = run_on_ranks(hand_loop, "ddp", str(tmp_path / "cpu"), world_size=1,
                          env={"CUDA_VISIBLE_DEVICES": ""})[0]  # fmt: skip
    assert on_gpu["error"] is None and on_cpu["error"] is None
    assert on_gpu["device"] == "cuda" and on_cpu["device"] == "cpu"
    assert on_gpu["seen"] == on_cpu["seen"] == 58
    assert max_abs_diff(on_gpu["state"], on_cpu["state"]) <= exactness.TOL
    assert max_abs_diff(on_gpu["file"], on_gpu["state"]) == 0.0  # torch.load of rt.save's file
    assert on_gpu["lr"] == on_cpu["lr"] and on_gpu["defaults_lr"] == on_cpu["defaults_lr"]


class CountingAdamW(torch.optim.AdamW):
    """A user's own optimizer class: its ``step`` override must run once per optimizer step
    (once per accumulation window), as in a plain loop."""

    def __init__(self, params: Any, **options: Any) -> None:
        super().__init__(params, **options)
        self.steps_taken = 0

    def step(self, closure: Any = None) -> Any:
        self.steps_taken += 1
        return super().step(closure)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).double()


def _schedule(optimizer: torch.optim.Optimizer) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def _subclass_loop(strategy: str, initial: dict[str, torch.Tensor]) -> dict[str, Any]:
    data = make_dataset(SAMPLES, dtype=torch.float64)
    with distkit.Runtime(strategy, grad_accum_steps=ACCUM, seed=7) as rt:
        model = _net()
        model.load_state_dict(initial)
        user = CountingAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, optimizer = rt.setup(model, user)
        assert isinstance(optimizer, CountingAdamW) and isinstance(optimizer, torch.optim.Optimizer)
        schedule = _schedule(optimizer)
        lrs = []
        for _ in range(EPOCHS):
            for x, y in rt.loader(data, batch_size=BATCH, shuffle=False):
                assert x.is_cuda and y.is_cuda
                rt.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()  # acts on a window's last micro-batch only
                optimizer.zero_grad()
            lrs.append(optimizer.param_groups[0]["lr"])
            schedule.step()  # per epoch, after the epoch's steps
        moments = [s["exp_avg"].device.type for s in optimizer.state.values()]
        return {
            "state": rt.full_state_dict(model),
            "steps": user.steps_taken,
            "lrs": lrs,
            "moments": moments,
            "schedule": schedule.state_dict()["last_epoch"],
        }


def _plain_loop(initial: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The same in plain torch on the same GPU: each window's gradient the mean over its
    samples (what one process with the whole window computes)."""
    x_all, y_all = (t.cuda() for t in make_dataset(SAMPLES, dtype=torch.float64).tensors)
    model = _net().cuda()
    model.load_state_dict(initial)
    optimizer = CountingAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    schedule = _schedule(optimizer)
    lrs = []
    window = BATCH * ACCUM
    for _ in range(EPOCHS):
        for start in range(0, SAMPLES, window):
            xs, ys = x_all[start : start + window], y_all[start : start + window]
            for x, y in zip(xs.split(BATCH), ys.split(BATCH), strict=True):
                loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / len(ys)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    return {"state": model.state_dict(), "steps": optimizer.steps_taken, "lrs": lrs}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_users_adamw_subclass_with_lambdalr_trains_as_plain_torch_on_the_gpu(strategy):
    initial = copy.deepcopy(_net().state_dict())
    got = _subclass_loop(strategy, initial)
    plain = _plain_loop(initial)
    windows = EPOCHS * -(-SAMPLES // (BATCH * ACCUM))  # 4 windows an epoch, the last short
    assert got["steps"] == plain["steps"] == windows
    assert got["moments"] == ["cuda"] * 4  # two weights, two biases: AdamW's state on the GPU
    assert got["lrs"] == plain["lrs"] == [1.0e-2, 0.5e-2] and got["schedule"] == EPOCHS
    assert max_abs_diff(got["state"], plain["state"]) <= exactness.TOL
    assert max_abs_diff(got["state"], initial) > 1e-3  # it trained: a skipped step would show


def _strict_loop(strategy: str) -> tuple[int, int]:
    """The hand loop's steady steps with synchronisation an error; the steps it checked and
    the steps it ran."""
    data = make_dataset(64, dtype=torch.float32)
    checked = ran = 0
    with distkit.Runtime(strategy, seed=1) as rt:
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9))  # fmt: skip
        schedule = _schedule(optimizer)
        loader = rt.loader(data, batch_size=4)
        last = len(loader) - 1
        try:
            for step, (x, y) in enumerate(loader):
                # the first two steps set things up (buckets, the momentum buffers); from
                # the third to the epoch's last (its end may agree with the other ranks)
                torch.cuda.set_sync_debug_mode("error" if 2 <= step < last else 0)
                checked += 2 <= step < last
                rt.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                schedule.step()
                ran += 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return checked, ran


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_hand_loop_steady_steps_raise_nothing_in_sync_debug_mode(strategy):
    """rt.loader's batches (pinned, copied without blocking), the set-up model's forward,
    rt.backward's weighting, the set-up optimizer's step and zero_grad, and LambdaLR: no
    host synchronisation between the set-up and the epoch's end."""
    checked, ran = _strict_loop(strategy)
    assert ran == 16 and checked == 13
