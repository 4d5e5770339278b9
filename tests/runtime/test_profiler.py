"""``rt.profile(...)`` in a user's own loop, and ``distkit.Profiler``'s settings checks."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.errors import ConfigurationError

pytestmark = pytest.mark.timeout(60)


def test_rt_profile_records_the_window_of_a_user_loop(tmp_path):
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    with distkit.Runtime() as rt:
        model = nn.Linear(4, 1)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        with rt.profile(wait=0, warmup=1, active=2, repeat=2, dir=tmp_path) as prof:
            for inputs, target in rt.loader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4):
                rt.backward(nn.functional.mse_loss(model(inputs), target))
                optimizer.step()
                optimizer.zero_grad()
                prof.step()
    # two cycles of warmup 1 + active 2 over 10 steps: a file each, of its own steps
    assert prof.enabled and len(prof.traces) == 2
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == sorted(
        p.name for p in prof.traces
    )
    steps = []
    for trace in prof.traces:
        events = json.loads(trace.read_text())["traceEvents"]
        steps.append(
            sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        )
    assert steps == [["ProfilerStep#1", "ProfilerStep#2"], ["ProfilerStep#4", "ProfilerStep#5"]]
    assert not torch.autograd.profiler._is_profiler_enabled


def test_rt_profile_whose_window_outlasts_the_loop_warns_that_nothing_was_written(tmp_path):
    with distkit.Runtime() as rt:
        model = nn.Linear(4, 1)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        window = rt.profile(skip_first=2, wait=0, warmup=1, active=1, dir=tmp_path)
        with pytest.warns(UserWarning, match="Profiler") as caught, window as prof:
            rt.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            prof.step()

    (message,) = [str(w.message) for w in caught]
    assert message == (
        "Profiler(skip_first=2, wait=0, warmup=1, active=1) records optimizer steps 4 to 4 "
        "(counted from 1), and this run ended after 1 step(s) under it: no step was profiled "
        f"on rank 0, and no trace was written to {str(tmp_path / 'rank0')!r}. Lower "
        "skip_first, wait or warmup (e.g. Profiler(wait=0, warmup=1, active=1) records the "
        "second step), or profile a longer run"
    )
    assert prof.traces == [] and list((tmp_path / "rank0").iterdir()) == []


def test_rt_profile_that_records_its_window_says_nothing(tmp_path, recwarn):
    with distkit.Runtime() as rt:
        model = nn.Linear(4, 1)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        with rt.profile(wait=0, warmup=0, active=1, dir=tmp_path) as prof:
            rt.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            prof.step()
    assert len(prof.traces) == 1
    assert not [w for w in recwarn if "Profiler(" in str(w.message)]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_profiler_refuses_a_dir_it_cannot_create_naming_it():
    with pytest.raises(ConfigurationError) as info:
        distkit.Profiler(dir="/proc/prof")  # /proc takes no new folder, for root too
    assert str(info.value).startswith(
        "Profiler(dir='/proc/prof'): '/proc' (the nearest existing folder of '/proc/prof') "
        "cannot be written: "
    )
    assert "pass a dir=... this process can create and write" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wait": -1}, r"Profiler\(wait=...\) must be an integer >= 0, got -1"),
        ({"active": 0}, r"Profiler\(active=...\) must be an integer >= 1, got 0"),
        ({"repeat": 1.5}, r"Profiler\(repeat=...\) must be an integer >= 0"),
        ({"ranks": []}, "pass a non-empty list of ranks"),
        ({"ranks": "0"}, "pass a non-empty list of ranks"),
        ({"ranks": [0, -1]}, r"each of Profiler\(ranks=...\) must be an integer >= 0, got -1"),
        ({"dir": 3}, r"Profiler\(dir=...\) must be a folder path"),
        ({"with_stack": "yes"}, "with_stack must be True or False"),
    ],
)
def test_profiler_refuses_bad_settings(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        distkit.Profiler(**kwargs)


def test_profiler_refuses_a_file_where_its_folder_goes(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigurationError, match=r"is a file, .* pass another dir"):
        distkit.Profiler(dir=tmp_path / "f")


def test_rt_profile_refuses_unknown_arguments_and_ranks_out_of_range(tmp_path):
    with distkit.Runtime() as rt:
        with pytest.raises(ConfigurationError, match=r"unknown argument\(s\) \['steps'\]"):
            rt.profile(steps=3).__enter__()
        with pytest.raises(ConfigurationError, match=r"rank\(s\) \[2\], and this job has 1"):
            rt.profile(distkit.Profiler(dir=tmp_path), ranks=[0, 2]).__enter__()
    assert not (tmp_path / "rank0").exists()
