"""``Trainer(profiler=...)``: a Chrome trace per chosen rank, of the window's steps only, with
distkit's phase ranges; off, no profiler and no range at all; bad settings refused."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.errors import ConfigurationError
from tests.support.gates import needs

pytestmark = pytest.mark.timeout(120)

PHASE_RANGES = {"distkit/data", "distkit/forward", "distkit/backward", "distkit/optimizer"}


def _data() -> TensorDataset:
    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


def _fit(folder: str, ranks: list[int] | None = None, *, fail_at: int | None = None) -> None:
    settings = distkit.Profiler(dir=folder, wait=1, warmup=1, active=2, ranks=ranks)
    model = nn.Linear(4, 1)

    def step_fn(module: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        if fail_at is not None and step_fn.calls == fail_at:  # type: ignore[attr-defined]
            raise RuntimeError("the user's step failed")
        step_fn.calls += 1  # type: ignore[attr-defined]
        return nn.functional.mse_loss(module(batch[0]), batch[1])

    step_fn.calls = 0  # type: ignore[attr-defined]
    with distkit.Trainer(batch_size=4, progress=False, max_steps=6, profiler=settings) as trainer:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), _data(), step_fn=step_fn)


def _names(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {event["name"] for event in events if "name" in event}


def test_fit_profiler_writes_a_chrome_trace_of_the_window_with_distkits_phases(tmp_path):
    _fit(str(tmp_path))
    (trace,) = (tmp_path / "rank0").glob("*.pt.trace.json")
    names = _names(trace)
    assert names >= PHASE_RANGES
    # wait=1, warmup=1, active=2: optimizer steps 2 and 3 (0-based) are recorded, no other
    assert {n for n in names if n.startswith("ProfilerStep#")} == {
        "ProfilerStep#2",
        "ProfilerStep#3",
    }
    assert not torch.autograd.profiler._is_profiler_enabled  # stopped at the fit's end
    assert not list(tmp_path.rglob("*.tmp"))


def test_fit_profiler_that_fails_mid_window_leaves_a_whole_trace_and_stops(tmp_path):
    with pytest.raises(RuntimeError, match="the user's step failed"):
        _fit(str(tmp_path), fail_at=3)  # inside the active steps 2..3
    (trace,) = (tmp_path / "rank0").glob("*.pt.trace.json")
    assert "ProfilerStep#2" in _names(trace)  # valid JSON: the cycle cut short, written whole
    assert not torch.autograd.profiler._is_profiler_enabled


def test_fit_profiler_whose_window_outlasts_the_run_says_so_naming_both(tmp_path):
    settings = distkit.Profiler(dir=tmp_path, wait=1, warmup=1, active=2)
    model = nn.Linear(4, 1)
    trainer = distkit.Trainer(batch_size=4, progress=False, max_steps=2, profiler=settings)
    with trainer, pytest.warns(UserWarning) as caught:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        trainer.fit(model, optimizer, _data(), loss_fn=nn.functional.mse_loss)

    (message,) = [str(w.message) for w in caught if "Profiler(" in str(w.message)]
    (trace,) = (tmp_path / "rank0").glob("*.pt.trace.json")  # torch's, of the end of the fit
    assert message == (
        "Profiler(skip_first=0, wait=1, warmup=1, active=2) records optimizer steps 3 to 4 "
        "(counted from 1), and this run ended after 2 step(s) under it: no step was profiled "
        f"on rank 0, and its trace {str(trace)!r} holds only what ran after the last step. "
        "Lower skip_first, wait or warmup (e.g. Profiler(wait=0, warmup=1, active=1) records "
        "the second step), or profile a longer run"
    )


def test_fit_without_profiler_creates_none_and_opens_no_range(tmp_path):
    model = nn.Linear(4, 1)
    # the test's own profiler: a range distkit opened would show in it, and a profiler
    # distkit started inside it would fail (torch allows one at a time)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    trainer = distkit.Trainer(batch_size=4, progress=False, max_steps=3)
    assert trainer.config.profiling is None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.profiler.profile(activities=cpu) as outer, trainer:
        trainer.fit(model, optimizer, _data(), loss_fn=nn.functional.mse_loss)
    names = {event.name for event in outer.events()}
    assert "aten::addmm" in names  # it did watch the fit
    assert not [n for n in names if n.startswith(("distkit/", "ProfilerStep#"))]


def test_fit_profiler_on_chosen_ranks_only(run_on_ranks, tmp_path):
    run_on_ranks(partial(_fit, str(tmp_path), [1]), world_size=2)
    assert not (tmp_path / "rank0").exists()
    (trace,) = (tmp_path / "rank1").glob("*.pt.trace.json")
    assert _names(trace) >= PHASE_RANGES


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tensorboard", "profiler='tensorboard'; allowed: None or False"),
        (1, "profiler=1; allowed"),
        (distkit.Profiler(ranks=[3]), r"names rank\(s\) \[3\], and this job has 1"),
    ],
)
def test_trainer_refuses_a_bad_profiler(value, message):
    with pytest.raises(ConfigurationError, match=message):
        distkit.Trainer(progress=False, profiler=value)


@needs("cuda")
def test_fit_profiler_on_cuda_records_kernels(tmp_path):
    model = nn.Linear(4, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    settings = distkit.Profiler(dir=str(tmp_path), wait=0, warmup=1, active=2)
    with distkit.Trainer(batch_size=4, progress=False, max_steps=4, profiler=settings) as trainer:
        trainer.fit(model, optimizer, _data(), loss_fn=nn.functional.mse_loss)
    (trace,) = (tmp_path / "rank0").glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)
