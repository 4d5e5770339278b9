"""Ranks that disagree fail on every rank, naming the ranks and their values, instead of hanging.

The comparison is a pure function (tested first); then real gloo processes that resume from
different checkpoints, hold data or models of other sizes, miss a file, or call
save_checkpoint on rank 0 only. Every multi-process test has a timeout: a hang fails it.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from distkit.errors import RankDisagreementError
from distkit.runtime._agreement import COLLECTIVE, Message, _ranks, disagreement, first_difference
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 90.0  # seconds for a multi-process case: far above its run time, far below a hang


# ---------------------------------------------------------------- the pure comparison
def _fit_message(**agreed: str) -> Message:
    return Message("fit", {"resume from": "no checkpoint", "train_data samples": "64", **agreed})


def test_agreement_identical_messages_agree():
    assert disagreement([_fit_message(), _fit_message(), _fit_message()]) is None


def test_agreement_names_the_ranks_and_values_that_differ():
    four = "step-000000004.pt (step 4)"
    messages = [_fit_message(**{"resume from": four})] * 2 + [_fit_message()]
    text = disagreement(messages)
    assert text is not None
    assert "resume from: ranks 0,1: step-000000004.pt (step 4); rank 2: no checkpoint" in text
    assert "train_data" not in text  # only what differs


def test_agreement_reports_every_key_that_differs():
    messages = [_fit_message(), _fit_message(**{"train_data samples": "60", "model": "b"})]
    text = disagreement(messages)
    assert text is not None
    assert "train_data samples: rank 0: 64; rank 1: 60" in text
    assert "model: rank 0: (not given); rank 1: b" in text


def test_agreement_a_rank_that_failed_to_prepare_is_named_with_its_error():
    failed = Message("fit", {}, error="CheckpointError: no checkpoint at /x.pt")
    text = disagreement([_fit_message(), failed, _fit_message()])
    assert text is not None
    assert "rank 1 could not prepare fit: CheckpointError: no checkpoint at /x.pt" in text
    assert "ranks 0,2 were ready" in text


def test_agreement_ranks_in_different_calls_are_named_with_the_fix():
    save = Message("save_checkpoint", {"global step": "4"}, shared={"rng": 1})
    text = disagreement([save, _fit_message()])
    assert text is not None
    assert "rank 0 in save_checkpoint; rank 1 in fit" in text
    assert COLLECTIVE in text and "if trainer.is_main:" in text


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([2], "rank 2"),
        ([0, 1], "ranks 0,1"),
        ([0, 1, 2, 3, 5], "ranks 0-3,5"),
        ([0, 2, 4], "ranks 0,2,4"),
        ([1, 2, 3, 4, 5, 6, 7, 9, 10], "ranks 1-7,9,10"),
    ],
)
def test_agreement_rank_lists_are_compressed(ranks, text):
    assert _ranks(ranks) == text


def test_agreement_first_difference_names_the_item():
    same = [("0.weight", "(16, 6)"), ("0.bias", "(16,)")]
    other = [("0.weight", "(16, 7)"), ("0.bias", "(16,)")]
    assert first_difference([same, same, other]) == (
        "first difference: ranks 0,1: 0.weight (16, 6); rank 2: 0.weight (16, 7)"
    )
    assert "rank 1: (none)" in first_difference([same, same[:1]])


# ---------------------------------------------------------------- real processes
def _fit_on_rank(folders: list[str] | None = None, *, resume=None, n: list[int] | None = None,
                 hidden: list[int] | None = None, max_steps=None) -> str:  # fmt: skip
    """fit on this rank with its own folder / data size / model width; returns what it raised."""
    trainer = distkit.Trainer(
        "ddp", batch_size=4, max_epochs=1, seed=3, progress=False, max_steps=max_steps,
        checkpoint_dir=None if folders is None else folders[_rank()], checkpoint_every=2,
        resume=resume[_rank()] if isinstance(resume, list) else resume,
    )  # fmt: skip
    torch.manual_seed(0)
    width = 16 if hidden is None else hidden[trainer.rank]
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))
    data = make_dataset(64 if n is None else n[trainer.rank])
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                    loss_fn=nn.functional.cross_entropy)  # fmt: skip
    except RankDisagreementError as exc:
        cause = exc.__cause__
        return f"RankDisagreementError: {exc}" + (f"\ncause: {cause!r}" if cause else "")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        trainer.close()
    return "trained"


def _rank() -> int:
    import os

    return int(os.environ["RANK"])


def _checkpoint_at_step_4(folder: Path) -> None:
    """A 1-process run that saves at steps 2 and 4 (then 'latest' names step 4)."""
    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=1, seed=3, progress=False,
                              checkpoint_dir=folder, checkpoint_every=2, max_steps=4)  # fmt: skip
    torch.manual_seed(0)
    model = make_mlp()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(64),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    trainer.close()


def test_agreement_ranks_resuming_from_different_checkpoints_all_fail_fast(tmp_path, run_on_ranks):
    _checkpoint_at_step_4(tmp_path / "source")
    folders = [tmp_path / f"rank{rank}" for rank in range(3)]
    for folder in folders[:2]:  # node-local disks: rank 2's has no checkpoint
        shutil.copytree(tmp_path / "source", folder)
    folders[2].mkdir()
    results = run_on_ranks(
        partial(_fit_on_rank, [str(f) for f in folders], resume="auto"),
        world_size=3,
        timeout=TIMEOUT,
    )
    for result in results:
        assert result.startswith("RankDisagreementError: the ranks disagree on what fit"), result
        assert "resume from: ranks 0,1: step-000000004.pt (step 4); rank 2: no checkpoint" in (
            result
        )
        assert "a checkpoint_dir every rank can read" in result
    assert not ckpt.CheckpointFolder(folders[2]).checkpoints()  # nothing trained, nothing saved


def test_agreement_ranks_resuming_from_different_steps_all_fail(tmp_path, run_on_ranks):
    _checkpoint_at_step_4(tmp_path / "source")
    folders = [tmp_path / "rank0", tmp_path / "rank1"]
    for folder in folders:
        shutil.copytree(tmp_path / "source", folder)
    (folders[1] / "step-000000004.pt").unlink()  # rank 1 only sees the step-2 file
    results = run_on_ranks(
        partial(_fit_on_rank, [str(f) for f in folders], resume="auto"), timeout=TIMEOUT
    )
    for result in results:
        assert (
            "resume from: rank 0: step-000000004.pt (step 4); rank 1: step-000000002.pt (step 2)"
            in result
        ), result


def test_agreement_a_checkpoint_missing_on_one_rank_fails_every_rank(tmp_path, run_on_ranks):
    _checkpoint_at_step_4(tmp_path / "source")
    there = str(tmp_path / "source" / "step-000000004.pt")
    missing = str(tmp_path / "elsewhere" / "step-000000004.pt")
    results = run_on_ranks(partial(_fit_on_rank, resume=[there, missing]), timeout=TIMEOUT)
    for result in results:
        assert result.startswith("RankDisagreementError: rank 1 could not prepare fit: "), result
        assert f"CheckpointError: no checkpoint at {missing}" in result
        assert "rank 0 was ready; every rank stops instead of waiting" in result
    assert "cause: CheckpointError(" in results[1]  # the failing rank chains its own error


def test_agreement_a_corrupt_checkpoint_on_one_rank_fails_every_rank(tmp_path, run_on_ranks):
    _checkpoint_at_step_4(tmp_path / "source")
    good = tmp_path / "source" / "step-000000004.pt"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[:300])
    results = run_on_ranks(partial(_fit_on_rank, resume=[str(good), str(bad)]), timeout=TIMEOUT)
    for result in results:
        assert "rank 1 could not prepare fit: CheckpointError:" in result, result
        assert "truncated or corrupt" in result


def test_agreement_a_dataset_of_another_length_on_one_rank_fails_every_rank(run_on_ranks):
    results = run_on_ranks(partial(_fit_on_rank, n=[64, 56]), timeout=TIMEOUT)
    for result in results:
        assert "train_data samples: rank 0: 64; rank 1: 56" in result, result
        assert "8 micro-batches per epoch" in result  # the batch plans differ too
        assert "7 micro-batches per epoch" in result


def test_agreement_a_model_of_other_shapes_on_one_rank_fails_every_rank(run_on_ranks):
    results = run_on_ranks(partial(_fit_on_rank, hidden=[16, 17]), timeout=TIMEOUT)
    for result in results:
        assert "model: rank 0: a Sequential: 4 tensors, 163 parameter values" in result, result
        assert "rank 1: a Sequential: 4 tensors, 173 parameter values" in result
        assert "first difference: rank 0: 0.weight (16, 6); rank 1: 0.weight (17, 6)" in result


def test_agreement_agreeing_ranks_train(run_on_ranks):
    assert run_on_ranks(partial(_fit_on_rank, max_steps=2), timeout=TIMEOUT) == ["trained"] * 2


def test_agreement_every_rank_failing_alike_raises_its_own_error(run_on_ranks):
    results = run_on_ranks(partial(_fit_on_rank, resume="/nonexistent/c.pt"), timeout=TIMEOUT)
    assert results == ["CheckpointError: no checkpoint at /nonexistent/c.pt"] * 2


# ---------------------------------------------------------------- save_checkpoint on rank 0 only
def _save_on_rank_zero_only(folder: str, others: str) -> str:
    """Rank 0 saves; the other ranks do ``others`` instead: close, exit, fit or evaluate."""
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=1, progress=False)
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_dataset(16)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    try:
        if trainer.is_main:
            trainer.save_checkpoint(Path(folder) / "c.pt")
        elif others == "close":
            trainer.close()
        elif others == "fit":
            trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
        elif others == "evaluate":
            trainer.evaluate(model, data, loss_fn=nn.functional.cross_entropy)
    except RankDisagreementError as exc:
        return f"RankDisagreementError: {exc}"
    finally:
        trainer.close()
    return "returned"


@pytest.mark.parametrize("others", ["close", "exit"])
def test_agreement_save_checkpoint_on_rank_zero_only_says_it_is_collective(
    others, tmp_path, run_on_ranks
):
    results = run_on_ranks(_save_on_rank_zero_only, str(tmp_path), others, timeout=TIMEOUT)
    assert results[1] == "returned"
    assert results[0].startswith(
        "RankDisagreementError: rank 0 waited for the other ranks in save_checkpoint, but one "
        "of them went away"
    ), results[0]
    assert "save_checkpoint are collective: call them on every rank" in results[0]
    assert "do not guard save_checkpoint with `if trainer.is_main:`" in results[0]
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("others", ["fit", "evaluate"])
def test_agreement_save_checkpoint_on_rank_zero_while_others_go_on_fails_both(
    others, tmp_path, run_on_ranks
):
    results = run_on_ranks(_save_on_rank_zero_only, str(tmp_path), others, timeout=TIMEOUT)
    for result in results:
        assert (
            f"the ranks are in different calls: rank 0 in save_checkpoint; rank 1 in {others}"
            in (result)
        ), result
        assert "distkit writes checkpoints from rank 0" in result


def _evaluate_on_rank(n: list[int]) -> str:
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False)
    try:
        trainer.evaluate(make_mlp(), make_dataset(n[trainer.rank]), metrics=[distkit.Accuracy()])
    except RankDisagreementError as exc:
        return str(exc)
    finally:
        trainer.close()
    return "evaluated"


def test_agreement_evaluate_on_data_of_other_lengths_fails_every_rank(run_on_ranks):
    for result in run_on_ranks(_evaluate_on_rank, [20, 21], timeout=TIMEOUT):
        assert "data samples: rank 0: 20; rank 1: 21" in result, result
        assert "the whole evaluation data" in result


def _fit_twice_with_auto_resume(folder: str) -> list:
    """Two fits on one trainer; the 2nd resumes from the checkpoint the 1st saved last (at the
    end of its epoch, after the last collective of that fit)."""
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=1, progress=False,
                              checkpoint_dir=folder, resume="auto")  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 50_000), nn.Tanh(), nn.Linear(50_000, 3))  # ~5 MB files
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    out: list = []
    try:
        for epochs in (1, 2):
            trainer.max_epochs = epochs
            result = trainer.fit(model, optimizer, make_dataset(16),
                                 loss_fn=nn.functional.cross_entropy)  # fmt: skip
            out.append(len(result.history))
    except RankDisagreementError as exc:
        out.append(str(exc))
    finally:
        trainer.close()
    return out


def test_agreement_a_fit_right_after_a_fit_finds_the_checkpoint_it_saved_last(
    tmp_path, run_on_ranks
):
    # rank 0 writes the last checkpoint; no rank may look for it before the write is done
    results = run_on_ranks(_fit_twice_with_auto_resume, str(tmp_path), timeout=TIMEOUT)
    assert results == [[1, 2], [1, 2]], results


def _full_state_on_rank_zero_only(others: str) -> str:
    """fsdp x2: rank 0 gathers the full weights; rank 1 does ``others`` instead."""
    with distkit.Runtime("fsdp") as rt:
        model = make_mlp()
        model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            if rt.rank == 0:
                rt.full_state_dict(model)
            elif others == "barrier":
                rt.barrier()
        except RankDisagreementError as exc:
            return f"RankDisagreementError: {exc}"
    return "returned"


@pytest.mark.parametrize("others", ["close", "barrier"])
def test_agreement_full_state_dict_on_one_rank_of_a_sharded_model_fails_naming_it(
    others, run_on_ranks
):
    """Before: gloo's raw 'Connection closed by peer' (rank 1 closed) or a wait on the
    gathers. Now a distkit error on rank 0 (and on rank 1 where it is in a distkit call),
    naming full_state_dict as a collective."""
    results = run_on_ranks(_full_state_on_rank_zero_only, others, timeout=TIMEOUT)
    assert results[0].startswith("RankDisagreementError"), results
    assert "full_state_dict" in results[0] and "collective" in results[0]
    if others == "barrier":
        assert "rank 0 in full_state_dict; rank 1 in rt.barrier" in results[1], results


class _Generator(nn.Linear):
    pass


class _Discriminator(nn.Linear):
    pass


def _setup_in_rank_order() -> str:
    """Two models of the same shapes; rank 1 sets them up in the other order."""
    with distkit.Runtime("ddp") as rt:
        models = [_Generator(4, 4), _Discriminator(4, 4)]
        try:
            for model in models if rt.rank == 0 else models[::-1]:
                rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except RankDisagreementError as exc:
            return str(exc)
    return "set up"


def test_agreement_models_set_up_in_another_order_on_one_rank_fail_every_rank(run_on_ranks):
    """Before: accepted (the same shapes), and each rank's gradients averaged with the other
    model's. The set-up's agreement now names the class too."""
    for result in run_on_ranks(_setup_in_rank_order, timeout=TIMEOUT):
        assert "rank 0: a _Generator" in result and "rank 1: a _Discriminator" in result, result
