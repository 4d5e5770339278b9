"""Checkpoints: the format, atomic files, safe loading, exact resume, and portability."""

from __future__ import annotations

import os
import stat
import time
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from tests.support.checkpoint_runs import (
    make_source_checkpoint,
    plain_model,
    resume_each,
    train_run,
)
from tests.support.exactness import DTYPE, TOL
from tests.support.workloads import make_dataset, max_abs_diff, without_timing

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]


# ---------------------------------------------------------------- the file format
class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


class _Code:
    """A class: loading an instance of it would need to run code."""


def test_checkpoint_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.atomic_save({"format": ckpt.FORMAT, "value": torch.tensor([1.0])}, path)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        ckpt.atomic_save({"format": ckpt.FORMAT, "value": _Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["value"].tolist() == [1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"], "a temp file was left behind"


def test_checkpoint_load_refuses_files_that_need_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format": ckpt.FORMAT, "version": 1, "obj": _Code()}, path)
    with pytest.raises(ckpt.CheckpointError, match="weights_only=True so that a file can never"):
        ckpt.load(path)


def test_checkpoint_load_reports_truncated_and_foreign_files(tmp_path):
    good = tmp_path / "good.pt"
    ckpt.atomic_save({"format": ckpt.FORMAT, "version": 1, "w": torch.randn(100)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ckpt.CheckpointError, match="truncated or corrupt"):
        ckpt.load(truncated)
    plain = tmp_path / "plain.pt"
    torch.save(nn.Linear(2, 2).state_dict(), plain)
    with pytest.raises(ckpt.CheckpointError, match="not a distkit checkpoint"):
        ckpt.load(plain)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint at"):
        ckpt.load(tmp_path / "missing.pt")
    newer = tmp_path / "newer.pt"
    ckpt.atomic_save({"format": ckpt.FORMAT, "version": ckpt.VERSION + 1}, newer)
    with pytest.raises(ckpt.CheckpointError, match="upgrade distkit"):
        ckpt.load(newer)


def test_checkpoint_folder_keeps_the_last_k_and_points_at_the_latest(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        folder.save({"format": ckpt.FORMAT, "version": 1, "step": step}, step)
    assert [p.name for p in folder.checkpoints()] == ["step-000000004.pt", "step-000000006.pt"]
    assert folder.latest() == folder.path_for(6)
    (tmp_path / ckpt.LATEST).unlink()
    assert folder.latest() == folder.path_for(6)


def test_checkpoint_folder_keeps_the_new_file_among_a_previous_runs_later_steps(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path, keep_last=2)
    for step in (10, 12):  # an older run went further
        folder.save({"format": ckpt.FORMAT, "version": 1, "step": step}, step)
    folder.save({"format": ckpt.FORMAT, "version": 1, "step": 2}, 2)
    assert folder.path_for(2).exists() and folder.latest() == folder.path_for(2)
    assert not folder.path_for(10).exists()  # the oldest written goes, not the lowest step


def test_checkpoint_save_refuses_objects_that_would_not_load(tmp_path):
    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=1, progress=False)
    net = nn.Linear(6, 3)
    trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), make_dataset(16),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match="cannot be loaded weights-only"):
        trainer.save_checkpoint(tmp_path / "bad.pt", extra={"obj": _Code()})
    assert list(tmp_path.iterdir()) == [], "a refused checkpoint left a file behind"


def test_checkpoint_strip_wrapper_prefix_only_when_every_key_has_it():
    assert ckpt.strip_wrapper_prefix({"module.w": 1, "module.b": 2}) == {"w": 1, "b": 2}
    assert ckpt.strip_wrapper_prefix({"module.w": 1, "b": 2}) == {"module.w": 1, "b": 2}


def test_checkpoint_rng_state_round_trips():
    import random

    import numpy as np

    state = ckpt.rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    ckpt.set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all()
    assert first[2] == again[2]


class _OnTheGpu:
    """FAKE CUDA tensor (no GPU here): what ``map_location="cuda"`` makes of a saved CPU
    tensor, as far as restoring needs: ``.numpy()`` refuses, ``.cpu()`` brings it back."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def cpu(self) -> torch.Tensor:
        return self._tensor

    def numpy(self):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


def test_checkpoint_rng_state_restores_from_a_checkpoint_loaded_onto_a_gpu():
    """On an H200 every resume failed so: the checkpoint is loaded onto the rank's GPU, the
    numpy generator's keys with it, and they went to numpy without .cpu() (docs/gpu.md)."""
    import numpy as np

    state = ckpt.rng_state()
    first = np.random.rand(3)
    state["numpy"]["keys"] = _OnTheGpu(state["numpy"]["keys"])
    state["torch"] = _OnTheGpu(state["torch"])
    ckpt.set_rng_state(state)
    assert (np.random.rand(3) == first).all()


# ---------------------------------------------------------------- training runs
# the runs (train_run, on_rank, make_source_checkpoint): tests/support/checkpoint_runs.py
@pytest.mark.parametrize(
    ("strategy", "world", "batch"), [("dp", 1, 8), ("ddp", 2, 4), ("fsdp", 2, 4)]
)
def test_checkpoint_resume_mid_epoch_is_exact(strategy, world, batch, tmp_path, run_on_ranks):
    """Interrupted at step 5 (mid epoch 0), resumed: equal to an uninterrupted run, dropout on."""
    whole = run_on_ranks(train_run, strategy, batch, world_size=world)[0]
    folder = str(tmp_path / "ckpt")
    run_on_ranks(
        partial(train_run, max_steps=5, every=5), strategy, batch, folder, world_size=world
    )
    saved = ckpt.load(ckpt.CheckpointFolder(folder).latest())
    assert saved["progress"] == {
        "epoch": 0,
        "position": 40,
        "global_step": 5,
        "skipped_steps": 0,
        "train_samples": 64,
    }
    assert not any(key.startswith("module.") for key in saved["model"])
    resumed = run_on_ranks(
        partial(train_run, resume="auto"), strategy, batch, folder, world_size=world
    )
    assert max_abs_diff(resumed[0]["state"], whole["state"]) <= TOL
    assert without_timing(resumed[0]["history"]) == without_timing(whole["history"])


def test_checkpoint_resume_skips_a_corrupt_latest_file(tmp_path, run_on_ranks):
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(train_run, max_steps=6, every=3), "dp", 8, str(folder), world_size=1)
    newest = ckpt.CheckpointFolder(folder).latest()
    assert newest is not None and newest.name == "step-000000006.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # as if the disk lost it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = distkit.trainer._resume.find_resume("auto", ckpt.CheckpointFolder(folder), "cpu")
    assert found is not None and found.payload["progress"]["global_step"] == 3
    assert found.label == "step-000000003.pt (step 3)"
    assert any("skipped 1 newer one(s): " in str(w.message) for w in caught)


def test_checkpoint_save_and_load_by_hand(tmp_path):
    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=1, seed=11, progress=False)
    net = plain_model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    trainer.fit(net, optimizer, make_dataset(64, dtype=DTYPE), loss_fn=nn.functional.cross_entropy)
    trainer.save_checkpoint(tmp_path / "hand.pt", extra={"note": "hello", "best": 0.5})
    other = distkit.Trainer("dp", batch_size=8, max_epochs=1, progress=False)
    info = other.load_checkpoint(tmp_path / "hand.pt")
    assert info["extra"] == {"note": "hello", "best": 0.5}
    assert info["producer"]["strategy"] == "dp" and info["progress"]["epoch"] == 1
    with pytest.raises(distkit.ConfigurationError, match="call fit"):
        other.save_checkpoint(tmp_path / "nothing.pt")


# ---------------------------------------------------------------- portability matrix
# horovod: test_horovod.py
SOURCES_AND_TARGETS = [("dp", 1, 8), ("ddp", 2, 4), ("apex", 2, 4), ("fsdp", 2, 4)]


def test_checkpoint_portability_matrix(tmp_path, run_on_ranks):
    """Saved under any strategy and world size, resumed under any other: same final weights.

    The apex cases use the FAKE legacy apex package and FAKE CUDA (see tests/support/fakes).
    """
    reference = train_run("dp", 8, model="plain")
    sources = {
        name: make_source_checkpoint(name, world, batch, tmp_path / name, run_on_ranks)
        for name, world, batch in SOURCES_AND_TARGETS
    }
    paths = [str(path) for path in sources.values()]
    for target, world, batch in SOURCES_AND_TARGETS:
        # every source resumed in turn by the same ranks (one start of them per target)
        runs = run_on_ranks(resume_each, target, batch, paths, world_size=world)[0]
        for source, resumed in zip(sources, runs, strict=True):
            diff = max_abs_diff(resumed["state"], reference["state"])
            assert diff <= TOL, f"{source} -> {target}: max diff {diff}"
            first = resumed["history"][0]["train_loss"]
            assert first == pytest.approx(reference["history"][0]["train_loss"], abs=TOL)


# ---------------------------------------------------------------- disk hygiene, pointer truth
def _payload(step: int) -> dict:
    progress = {"epoch": 0, "position": 0, "global_step": step}
    return {"format": ckpt.FORMAT, "version": 1, "progress": progress}


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_file_mode_follows_the_umask_like_torch_save(umask, tmp_path):
    previous = os.umask(umask)
    try:
        torch.save({"w": 1}, tmp_path / "by_torch.pt")
        ckpt.atomic_save(_payload(1), tmp_path / "by_distkit.pt")
        ckpt.CheckpointFolder(tmp_path / "folder").save(_payload(2), 2)
    finally:
        os.umask(previous)
    expected = stat.S_IMODE((tmp_path / "by_torch.pt").stat().st_mode)
    assert expected == 0o666 & ~umask
    for path in (tmp_path / "by_distkit.pt", tmp_path / "folder" / "step-000000002.pt"):
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


def _leftover(folder: Path, name: str, age_s: float) -> Path:
    path = folder / name
    path.write_bytes(b"x" * 1000)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_checkpoint_folder_save_removes_temp_files_that_killed_saves_left(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path, keep_last=2)
    folder.save(_payload(2), 2)
    stale = [
        _leftover(tmp_path, ".step-000000004.pt.k3j_x9a1.tmp", 60),  # mkstemp's naming
        _leftover(tmp_path, ".step-000000004.pt.0123456789ab.tmp", 60),
        _leftover(tmp_path, ".latest.00aa11bb22cc.tmp", 60),
        _leftover(tmp_path, ".write-check.00aa11bb22cc.tmp", 60),
    ]
    live = _leftover(tmp_path, ".step-000000006.pt.feedfeedfeed.tmp", -60)  # being written now
    mine = _leftover(tmp_path, ".notes.tmp", 60)  # not distkit's: never touched
    folder.save(_payload(4), 4)
    assert not any(path.exists() for path in stale)
    assert live.exists() and mine.exists()


def test_checkpoint_folder_disk_use_stays_bounded_by_keep_last(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path, keep_last=2)
    for step in range(1, 9):
        _leftover(tmp_path, f".step-{step + 1:09d}.pt.{step:012x}.tmp", 60)  # a killed save
        folder.save(_payload(step), step)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-000000007.pt", "step-000000008.pt"], names


def test_checkpoint_failed_latest_write_leaves_no_temp_file(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path, keep_last=3)
    (tmp_path / ckpt.LATEST).mkdir()  # the pointer cannot be replaced
    with pytest.raises(ckpt.CheckpointError, match=r"cannot write the checkpoint .*latest"):
        folder.save(_payload(2), 2)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    (tmp_path / ckpt.LATEST).rmdir()
    folder.save(_payload(4), 4)
    assert folder.latest() == folder.path_for(4)


def test_checkpoint_resume_auto_takes_the_highest_step_when_latest_lags(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path)
    for step in (2, 4):
        folder.save(_payload(step), step)
    (tmp_path / ckpt.LATEST).write_text("step-000000002.pt\n")  # as if it crashed before this
    old = time.time() - 60
    os.utime(tmp_path / ckpt.LATEST, (old, old))
    os.utime(folder.path_for(2), (old, old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a lagging pointer is normal: no warning
        found = distkit.trainer._resume.find_resume("auto", folder, "cpu")
    assert found is not None and found.label == "step-000000004.pt (step 4)"


def test_checkpoint_resume_auto_orders_by_step_number_not_by_name(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path)
    folder.save(_payload(999_999_999), 999_999_999)
    folder.save(_payload(1_000_000_000), 1_000_000_000)  # 10 digits: sorts first by name
    found = distkit.trainer._resume.find_resume("auto", folder, "cpu")
    assert found is not None and found.payload["progress"]["global_step"] == 1_000_000_000


def test_checkpoint_resume_auto_warns_about_a_second_run_in_the_folder(tmp_path):
    folder = ckpt.CheckpointFolder(tmp_path, keep_last=5)
    folder.save(_payload(12), 12)  # an earlier run went further
    old = time.time() - 60
    os.utime(folder.path_for(12), (old, old))
    folder.save(_payload(2), 2)  # this run's latest
    with pytest.warns(UserWarning, match="holds files of two runs"):
        found = distkit.trainer._resume.find_resume("auto", folder, "cpu")
    assert found is not None and found.label == "step-000000012.pt (step 12)"


def _save_where_rank_zero_cannot_write(path: str) -> str:
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False)
    net = nn.Linear(6, 3)
    trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), make_dataset(16),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    try:
        trainer.save_checkpoint(path)
    except ckpt.CheckpointError as exc:
        return str(exc)
    finally:
        trainer.close()
    return "no error"


def test_checkpoint_save_failing_on_rank_zero_fails_on_every_rank(tmp_path, run_on_ranks):
    (tmp_path / "occupied").write_text("a file, not a folder")
    target = str(tmp_path / "occupied" / "c.pt")
    messages = run_on_ranks(_save_where_rank_zero_cannot_write, target, world_size=2, timeout=60)
    assert messages[0].startswith(f"cannot write the checkpoint {target} "), messages[0]
    assert messages[1].startswith("rank 0 could not write the checkpoint:"), messages[1]
