"""Sharded checkpoints (torch.distributed.checkpoint) of HSDP (issue 28, part 3).

``FSDPStrategy(replicate=2, checkpoint="sharded")`` on 4 gloo ranks holds every parameter and
its Adam state as a DTensor placed ``(Replicate(), Shard(0))`` on a 2x2 mesh. One such fit
saves mid-epoch checkpoints and runs on to its end (the uninterrupted run); its step-3
checkpoint resumes under plain fsdp x2, fsdp x4, a world of one and HSDP 2x1, and fsdp x2's
resumes under HSDP 2x2, each ending equal to it (weights and AdamW state, 1e-6). Every resume
is made both ways distkit reads shards: into the plain model before its set-up (``resume=``)
and into the set-up DTensors (``load_checkpoint`` after a fit); fsdp x3 reads it into uneven
slices. The shards folder holds each replicated slice once; a checkpoint that lost shards is
refused, on every rank, by name.

HSDP 2x1 (shard groups of one rank) found a bug: there ``full_tensor()`` gathers nothing and
returns the local tensor itself, so on the CPU ``trainer.full_state_dict()`` and the full
optimizer state were views of the live tensors, and changed as training went on.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from tests.support.exactness import DTYPE, TOL  # the fits train in float64
from tests.support.multiprocess import run_on_ranks
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)

N = 53  # global batches of 8, 2 accumulated: 7 batches (the last of 5), 4 steps an epoch
STEPS = 8  # 2 epochs; checkpoint_every=3: steps 3 (mid-epoch 1), 6 (mid-epoch 2) and 8
MID = "step-000000003.pt"
run = partial(run_on_ranks, agent_store=True, timeout=150)


def train(batch: int, folder: str | None = None, *, replicate: int = 1,
          reload: str | None = None, fit_again: bool = True,
          **settings: Any) -> dict[str, Any]:  # fmt: skip
    """A fit of ``make_mlp`` with AdamW on uneven data, sharded checkpoints every 3 steps.

    ``reload``: then the weights and the whole Adam state spoiled, ``load_checkpoint(reload)``
    into the set-up model (DTensors, where sharded) and, with ``fit_again``, the fit run
    again from there.
    """
    torch.manual_seed(0)
    strategy = distkit.FSDPStrategy(replicate=replicate, checkpoint="sharded")
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, checkpoint_dir=folder,
                              checkpoint_every=3, **settings)  # fmt: skip
    model = make_mlp(dtype=DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = make_dataset(N, dtype=DTYPE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    # taken before the spoiling below: a snapshot must not change with the live tensors
    out = {"first": _outcome(trainer, model, optimizer),
           "warnings": [str(w.message) for w in caught]}  # fmt: skip
    if reload is not None:
        kept = copy.deepcopy(out["first"])
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
                for value in optimizer.state[p].values():
                    value.zero_()  # exp_avg, exp_avg_sq and step
        first = out["first"]
        first["snapshot kept"] = max_abs_diff(first["state"], kept["state"]) == 0.0 and (
            optimizer_diff(first["optimizer"], kept["optimizer"]) == 0.0
        )
        trainer.load_checkpoint(reload)
        out["loaded"] = _outcome(trainer, model, optimizer)
        if fit_again:
            trainer.max_steps = None
            trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
            out["reloaded"] = _outcome(trainer, model, optimizer)
    trainer.close()
    return out


def _outcome(trainer: distkit.Trainer, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    first = next(model.parameters())
    local = first.to_local() if hasattr(first, "to_local") else first
    return {
        "state": trainer.full_state_dict(),
        "optimizer": trainer.strategy.state_io.optimizer_state_dict(optimizer),  # full tensors
        "steps": trainer.global_step,
        "mesh": getattr(getattr(first, "device_mesh", None), "shape", None),
        "local_rows": local.shape[0],
    }


def optimizer_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference of two full AdamW states (step, exp_avg, exp_avg_sq)."""
    assert a["state"].keys() == b["state"].keys() == {0, 1, 2, 3}
    return max(max_abs_diff(entries, b["state"][index]) for index, entries in a["state"].items())


def assert_ends_as(outcome: dict[str, Any], whole: dict[str, Any], name: str) -> None:
    assert outcome.get("snapshot kept", True), (
        f"{name}: full_state_dict() or the full optimizer state changed with the live tensors"
    )
    assert outcome["steps"] == whole["steps"] == STEPS, name
    weights = max_abs_diff(outcome["state"], whole["state"])
    adam = optimizer_diff(outcome["optimizer"], whole["optimizer"])
    assert weights <= TOL and adam <= TOL, f"{name}: weights {weights:.2e}, AdamW {adam:.2e}"


def data_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.distcp"))


# ---------------------------------------------------------------- the runs, shared
@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    """HSDP 2x2, uninterrupted, with its checkpoints at steps 3, 6 and 8 (rank 0's outcome)."""
    folder = tmp_path_factory.mktemp("hsdp")
    ranks = run(partial(train, replicate=2), 2, str(folder), world_size=4)
    for rank in ranks:
        assert rank["first"]["mesh"] == (2, 2) and rank["first"]["local_rows"] == 8
        assert max_abs_diff(rank["first"]["state"], ranks[0]["first"]["state"]) == 0.0
        assert optimizer_diff(rank["first"]["optimizer"], ranks[0]["first"]["optimizer"]) == 0.0
    return ranks[0]["first"], folder


@pytest.fixture(scope="module")
def fsdp_x2(hsdp, tmp_path_factory) -> tuple[dict[str, Any], Path]:
    """Plain fsdp x2 resumed from the HSDP step-3 checkpoint, saving its own."""
    folder = tmp_path_factory.mktemp("fsdp_x2")
    mid = str(hsdp[1] / MID)
    return run(partial(train, resume=mid, reload=mid), 4, str(folder), world_size=2)[0], folder


@pytest.fixture(scope="module")
def one_process(hsdp) -> dict[str, Any]:
    """A world of one resumed from the HSDP step-3 checkpoint: plain tensors, read whole."""
    mid = str(hsdp[1] / MID)
    return run(partial(train, resume=mid, reload=mid), 8, world_size=1)[0]


# ---------------------------------------------------------------- HSDP 2x2 to other layouts
def test_hsdp_checkpoint_resumes_under_fsdp_x2_exactly(hsdp, fsdp_x2):
    whole, folder = hsdp
    saved = ckpt.load(folder / MID)
    assert saved["producer"]["world_size"] == 4 and saved["progress"]["position"] == 48
    assert all(t.device.type == "meta" for t in saved["model"].values())  # the data: shards
    result = fsdp_x2[0]
    assert result["first"]["mesh"] == (2,)
    assert_ends_as(result["first"], whole, "fsdp x2, resume=")
    assert_ends_as(result["reloaded"], whole, "fsdp x2, load_checkpoint into its DTensors")


@pytest.mark.parametrize(
    ("world", "batch", "replicate", "mesh"),
    [(4, 2, 1, (4,)), (2, 4, 2, (2, 1)), (1, 8, 1, None)],
    ids=["fsdp-x4", "hsdp-2x1", "one-process"],
)
def test_hsdp_checkpoint_resumes_under_another_layout_exactly(
    world, batch, replicate, mesh, hsdp, one_process
):
    """fsdp x4 slices each parameter in 4 (the checkpoint's chunks are halves); HSDP 2x1
    replicates whole tensors (``full_tensor()`` gathers nothing there); one process reads
    every chunk into plain tensors."""
    whole, folder = hsdp
    mid = str(folder / MID)
    resumed = partial(train, replicate=replicate, resume=mid, reload=mid)
    result = one_process if world == 1 else run(resumed, batch, world_size=world)[0]
    assert result["first"]["mesh"] == mesh
    assert_ends_as(result["first"], whole, f"{mesh}, resume=")
    assert_ends_as(result["reloaded"], whole, f"{mesh}, load_checkpoint into the set-up model")
    # what load_checkpoint read is the step-3 state, to the bit, whatever the layout
    assert max_abs_diff(result["loaded"]["state"], one_process["loaded"]["state"]) == 0.0
    assert optimizer_diff(result["loaded"]["optimizer"], one_process["loaded"]["optimizer"]) == 0.0


def test_hsdp_checkpoint_loads_into_uneven_slices_across_its_chunks(hsdp, one_process):
    """fsdp x3 slices 16 rows as 6, 6, 4: rank 1's rows 6..12 span both halves the HSDP
    ranks wrote. Loaded into the set-up DTensors, it is the step-3 state to the bit."""
    mid = str(hsdp[1] / MID)
    result = run(partial(train, max_steps=1, reload=mid, fit_again=False), 2, world_size=3)
    assert [r["loaded"]["local_rows"] for r in result] == [6, 6, 4]
    loaded = result[0]["loaded"]
    assert max_abs_diff(loaded["state"], one_process["loaded"]["state"]) == 0.0
    assert optimizer_diff(loaded["optimizer"], one_process["loaded"]["optimizer"]) == 0.0


# ---------------------------------------------------------------- fsdp x2 to HSDP 2x2
def test_fsdp_x2_checkpoint_resumes_under_hsdp_exactly(hsdp, fsdp_x2):
    whole = hsdp[0]
    path = fsdp_x2[1] / "step-000000006.pt"
    assert ckpt.load(path)["producer"]["world_size"] == 2
    result = run(partial(train, replicate=2, resume=str(path), reload=str(path)), 2,
                 world_size=4)[0]  # fmt: skip
    assert result["first"]["mesh"] == (2, 2)
    assert_ends_as(result["first"], whole, "HSDP 2x2 from fsdp x2, resume=")
    assert_ends_as(result["reloaded"], whole, "HSDP 2x2 from fsdp x2, load_checkpoint")


def test_hsdp_shards_hold_each_replicated_slice_once(hsdp, fsdp_x2):
    """The two replica groups hold the same slices: the folder holds them once (DCP's dedup),
    as many bytes as fsdp x2's folder for the same model and optimizer."""
    hsdp_folder = Path(ckpt.load(hsdp[1] / MID)["shards"])
    fsdp_folder = Path(ckpt.load(fsdp_x2[1] / "step-000000006.pt")["shards"])
    hsdp_bytes, fsdp_bytes = data_bytes(hsdp_folder), data_bytes(fsdp_folder)
    assert hsdp_bytes == fsdp_bytes, (hsdp_bytes, fsdp_bytes)  # twice as many if duplicated
    from torch.distributed.checkpoint import FileSystemReader

    for folder, total in ((hsdp_folder, hsdp_bytes), (fsdp_folder, fsdp_bytes)):
        stored = FileSystemReader(str(folder)).read_metadata().storage_data.values()
        assert sum(item.length for item in stored) == total  # no byte the metadata skips


# ---------------------------------------------------------------- hostile
def test_hsdp_checkpoint_that_lost_shards_is_refused_and_auto_falls_back(hsdp, tmp_path):
    """Step 8's shards folder deleted, one data file of step 6's deleted (the largest: with
    the dedup, a file of a replica holds slices no other file has): each is refused by name,
    and resume="auto" falls back to step 3 and still ends exactly as the uninterrupted run."""
    whole, source = hsdp
    folder = tmp_path / "broken"
    shutil.copytree(source, folder)
    shutil.rmtree(ckpt.load(folder / "step-000000008.pt")["shards"])
    six = Path(ckpt.load(folder / "step-000000006.pt")["shards"])
    largest = max(six.glob("*.distcp"), key=lambda p: p.stat().st_size)
    largest.unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"shards folder .* is not beside it"):
        ckpt.load(folder / "step-000000008.pt")
    with pytest.raises(ckpt.CheckpointError, match=f"damaged shards .*{largest.name} is missing"):
        ckpt.load(folder / "step-000000006.pt")
    result = run(partial(train, resume="auto"), 8, str(folder), world_size=1)[0]
    assert_ends_as(result["first"], whole, "resume='auto' past two damaged checkpoints")
    (fell_back,) = [w for w in result["warnings"] if "resume='auto'" in w]
    assert "resuming from step-000000003.pt (step 3)" in fell_back
    assert "skipped 2 newer" in fell_back


def _resume_from_own_path(paths: list[str]) -> str:
    try:
        train(2, replicate=2, resume=paths[int(os.environ["RANK"])])
    except Exception as exc:  # returned to the test
        return f"{type(exc).__name__}: {exc}"
    return "resumed"


def test_hsdp_ranks_that_cannot_see_the_shards_stop_every_rank(hsdp, tmp_path):
    """Checkpoints on node-local disks: the second node (ranks 2, 3) has the checkpoint file
    but not the shards folder. No rank starts training (a hang); each says why."""
    path = hsdp[1] / "step-000000006.pt"
    other = tmp_path / "node1"
    other.mkdir()
    shutil.copy(path, other / path.name)
    paths = [str(path)] * 2 + [str(other / path.name)] * 2
    for message in run(_resume_from_own_path, paths, world_size=4):
        assert message.startswith("RankDisagreementError"), message
        assert "ranks 2,3 could not prepare fit: CheckpointError" in message, message
        assert "is not beside it" in message and "ranks 0,1 were ready" in message, message
