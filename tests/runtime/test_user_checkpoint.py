"""rt.save / rt.load in a user's own loop: saved mid-epoch and resumed (at the same or another
world size) the loop ends with the weights of an uninterrupted run; a save on some ranks only
fails there instead of hanging; wrong files and names are refused. Real gloo processes."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.checkpoint._fits import model_misfits
from distkit.errors import CheckpointError, RankDisagreementError
from tests.support.exactness import DTYPE, TOL  # the runs compared train in float64
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)

N = 21
EPOCHS = 2


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def save_after(batch: int, path: str, windows: int) -> dict[str, Any]:
    """Train ``windows`` accumulation windows of epoch 0, save, and stop (as if killed)."""
    torch.manual_seed(0)
    with distkit.Runtime("ddp", grad_accum_steps=2, seed=4) as rt:
        model = make_mlp(dtype=DTYPE)
        model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        loader = rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch)
        done = 0
        for x, y in loader:
            rt.backward(_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if rt.sync_gradients:
                done += 1
                if done == windows:
                    rt.save(path, {"model": model, "optimizer": optimizer, "loader": loader,
                                   "epoch": 0})  # fmt: skip
                    return {"saved": loader.state_dict()}
        raise AssertionError("the epoch ended before the save")


def resume_from(batch: int, path: str) -> dict[str, Any]:
    torch.manual_seed(123)  # other initial weights: the checkpoint must replace them all
    with distkit.Runtime("ddp", grad_accum_steps=2, seed=4) as rt:
        model = make_mlp(dtype=DTYPE)
        model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        loader = rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch)
        rest = rt.load(path, {"model": model, "optimizer": optimizer, "loader": loader})
        for _ in range(rest["epoch"], EPOCHS):
            for x, y in loader:
                rt.backward(_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        return {"state": rt.full_state_dict(model), "rest": rest}


def uninterrupted(batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with distkit.Runtime("ddp", grad_accum_steps=2, seed=4) as rt:
        model = make_mlp(dtype=DTYPE)
        model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        loader = rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch)
        for _ in range(EPOCHS):
            for x, y in loader:
                rt.backward(_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        return {"state": rt.full_state_dict(model)}


@pytest.mark.parametrize("resume_world", [2, 1], ids=["same-world", "2-to-1"])
def test_save_mid_epoch_then_load_equals_an_uninterrupted_run(run_on_ranks, tmp_path, resume_world):
    path = str(tmp_path / "ckpt.pt")
    reference = run_on_ranks(uninterrupted, 8, world_size=1)[0]
    saved = run_on_ranks(save_after, 4, path, 1, world_size=2)
    assert saved[0]["saved"] == {"epoch": 0, "position": 16}  # one window: 2 global batches
    batch = 8 // resume_world
    resumed = run_on_ranks(resume_from, batch, path, world_size=resume_world)
    for rank in resumed:
        assert rank["rest"] == {"epoch": 0}
        assert max_abs_diff(rank["state"], reference["state"]) <= TOL


def _save_on_rank_0_only(path: str) -> str:
    with distkit.Runtime("ddp") as rt:
        model = make_mlp()
        model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            if rt.rank == 0:
                rt.save(path, {"model": model})
            else:
                rt.evaluate(model, make_dataset(4), loss_fn=_loss)
        except RankDisagreementError as exc:
            return str(exc)
        return "no error"


def test_a_save_on_some_ranks_only_fails_instead_of_hanging(run_on_ranks, tmp_path):
    messages = run_on_ranks(_save_on_rank_0_only, str(tmp_path / "x.pt"))
    assert all("the ranks are in different calls" in m for m in messages)
    assert not (tmp_path / "x.pt").exists()


def _save_mid_loop_on_rank_0_only(path: str) -> dict[str, str]:
    """``if rt.is_main: rt.save(...)`` after a step in the middle of an epoch: rank 1 goes on
    into its next backward (the gradients' all-reduce) instead."""
    seen: dict[str, str] = {"finally": "no"}
    try:
        with distkit.Runtime("ddp") as rt:
            model = make_mlp()
            model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for i, (x, y) in enumerate(rt.loader(make_dataset(64), batch_size=4)):
                rt.backward(_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                if i == 3 and rt.is_main:
                    rt.save(path, {"model": model, "optimizer": optimizer})
    except Exception as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        seen["finally"] = "yes"
    return seen


def test_a_save_on_rank_0_only_mid_loop_raises_a_distkit_error_on_every_rank(
    run_on_ranks, tmp_path
):
    """Before, gloo paired rank 0's agreement with rank 1's gradient all-reduce and aborted
    one process in C++ (``gloo::EnforceNotMet``: no exception, no ``finally``). Now rank 0
    finds rank 1 gone on past the save and raises, naming it; its failure stops rank 1."""
    saver, other = run_on_ranks(_save_mid_loop_on_rank_0_only, str(tmp_path / "x.pt"))
    assert saver["finally"] == other["finally"] == "yes"
    assert saver["error"].startswith("RankDisagreementError: this rank waited"), saver
    assert "in rt.save" in saver["error"] and "rank 1 in epoch 1, step 5" in saver["error"]
    assert "do not guard it with `if rt.is_main:`" in saver["error"]
    assert other["error"].startswith("PeerFailureError"), other
    assert not (tmp_path / "x.pt").exists()


def test_a_save_in_the_middle_of_an_accumulation_window_warns(tmp_path):
    """Its gradients are not in the file: a resume would not take the step this loop takes."""
    with distkit.Runtime("dp", grad_accum_steps=2) as rt:
        model = make_mlp()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for i, (x, y) in enumerate(rt.loader(make_dataset(16), batch_size=4)):
            rt.backward(_loss(model(x), y))
            if i == 0:
                with pytest.warns(UserWarning, match="middle of an accumulation window"):
                    rt.save(tmp_path / "mid.pt", {"model": model})
            optimizer.step()
            optimizer.zero_grad()
            if i == 1:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # at the window's end: no word
                    rt.save(tmp_path / "end.pt", {"model": model})
                break


def test_load_into_a_model_it_does_not_fit_changes_nothing(tmp_path):
    """Before: the tensors that fit were loaded, then the refusal came (a half-loaded model).
    Now it is refused before anything is loaded, naming the entries; so is an integer tensor
    for a floating-point entry (torch casts it)."""
    path = tmp_path / "ckpt.pt"
    with distkit.Runtime("dp") as rt:
        saved = rt.setup(make_mlp(seed=1))
        rt.save(path, {"model": saved})
        wider = rt.setup(make_mlp(classes=5, seed=2))
        before = {k: v.clone() for k, v in wider.module.state_dict().items()}
        with pytest.raises(CheckpointError, match=r"2.weight: checkpoint \(3, 16\), model "
                           r"\(5, 16\).*Nothing was loaded"):  # fmt: skip
            rt.load(path, {"model": wider})
        assert all(torch.equal(before[k], v) for k, v in wider.module.state_dict().items())
        # an int64 tensor for a float parameter: torch would cast it without a word
        ints = {k: v.long() if k == "0.weight" else v for k, v in saved.module.state_dict().items()}
        shapes = {k: v.shape for k, v in saved.module.state_dict().items()}
        (problem,) = model_misfits(ints, shapes, saved.module)
        assert problem.startswith("0.weight: checkpoint torch.int64, model torch.float32")


def test_load_refuses_what_it_cannot_restore(tmp_path):
    path = tmp_path / "ckpt.pt"
    with distkit.Runtime("dp") as rt:
        model = make_mlp()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(distkit.ConfigurationError, match=r"that rt\.setup returned"):
            rt.save(str(path), {"model": model.module})
        with pytest.raises(distkit.ConfigurationError, match="takes a dict"):
            rt.save(str(path), [model])  # type: ignore[arg-type]
        rt.save(str(path), {"model": model, "step": 3})
        assert rt.load(str(path), {"model": model}) == {"step": 3}
        with pytest.raises(CheckpointError, match="holds no 'optimizer'"):
            rt.load(str(path), {"optimizer": optimizer})
        with pytest.raises(CheckpointError, match="saved 'step' as a value"):
            rt.load(str(path), {"step": model})
        with pytest.raises(CheckpointError, match="cannot be loaded weights-only"):
            rt.save(str(tmp_path / "obj.pt"), {"thing": object()})
        assert not (tmp_path / "obj.pt").exists()
    trainer = distkit.Trainer("dp", progress=False, batch_size=4, checkpoint_dir=tmp_path / "t")
    net = make_mlp()
    trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), make_dataset(8), _loss)
    trainer.close()
    written = next(Path(tmp_path / "t").glob("step-*.pt"))
    with distkit.Runtime("dp") as rt:
        model = rt.setup(make_mlp())
        # one layout: a Trainer's checkpoint loads into the loop's model (its other entries
        # are values); a loader asked of it is refused, naming what it holds
        assert rt.load(str(written), {"model": model})["progress"]["global_step"] == 2
        loader = rt.loader(make_dataset(8))
        with pytest.raises(CheckpointError, match="saved 'progress' as a value"):
            rt.load(str(written), {"progress": loader})
