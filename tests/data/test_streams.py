"""Streams as training and validation data: sharded exactly, uneven ends that never hang,
exact-once evaluation, resume mid-stream. Real gloo processes (and horovodrun below)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import distkit
from distkit.errors import ConfigurationError
from tests.support.exactness import DTYPE, TOL
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.multiprocess import run_on_ranks
from tests.support.paths import ROOT
from tests.support.stream_workloads import (
    BatchIterable,
    SampleStream,
    SeekableStream,
    census,
    rank_share_steps,
    train_map_style,
    train_steps_by_hand,
    train_stream,
)
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)

needs_horovod = needs("horovod")


@functools.cache
def _reference(batch_size: int, grad_accum_steps: int = 1, epochs: int = 2) -> dict:
    return train_map_style(batch_size, grad_accum_steps=grad_accum_steps, epochs=epochs)


def _same_training(result: dict, reference: dict) -> None:
    assert max_abs_diff(result["state"], reference["state"]) <= TOL
    assert result["steps"] == reference["steps"]
    for mine, theirs in zip(result["history"], reference["history"], strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], abs=TOL)
        assert mine["val_acc"] == pytest.approx(theirs["val_acc"], abs=1e-12)
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], abs=TOL)


# ---------------------------------------------------------------------------- one process
def test_streams_a_stream_trains_like_the_same_data_map_style_in_one_process():
    _same_training(train_stream("dp", 8), _reference(8))
    _same_training(train_stream("dp", 4, grad_accum_steps=2, num_workers=2), _reference(4, 2))


def test_streams_an_iterable_of_batches_trains_batch_by_batch():
    # batches of 4 from the iterable; one process with batch 4 map-style sees the same ones
    _same_training(train_stream("dp", 999, kind="batches"), _reference(4))


def test_streams_a_seekable_stream_is_asked_to_seek_on_resume(tmp_path):
    stream = SeekableStream(61)
    model = make_mlp(dtype=DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"batch_size": 8, "progress": False, "checkpoint_dir": tmp_path}
    with distkit.Trainer("dp", max_steps=3, checkpoint_every=3, **kwargs) as trainer:
        trainer.fit(model, opt, stream, loss_fn=nn.functional.cross_entropy)
    with distkit.Trainer("dp", resume="auto", **kwargs) as trainer:
        trainer.fit(model, opt, stream, loss_fn=nn.functional.cross_entropy)
        assert trainer.global_step == 8  # ceil(61 / 8)
    assert stream.seeks == [24]  # 3 steps x 8 samples: not read again


# ---------------------------------------------------------------------------- gloo ranks
@pytest.mark.parametrize(
    ("world", "batch", "accum", "workers", "kind"),
    [(2, 4, 1, 0, "samples"), (3, 2, 1, 0, "samples"), (2, 2, 2, 0, "shuffled")],
)
def test_streams_ranks_train_like_one_process_with_the_global_batch(
    world, batch, accum, workers, kind
):
    """61 samples: the last global batch is partial on 2 and 3 ranks; evaluation of the
    stream gives the accuracy of one process, which is only right if every sample counts
    once. A stream that shuffles with torch's generator agrees with itself on every rank."""
    results = run_on_ranks(
        functools.partial(
            train_stream, "ddp", batch, kind=kind, grad_accum_steps=accum, num_workers=workers
        ),
        world_size=world, timeout=240,
    )  # fmt: skip
    if kind == "shuffled":
        reference = train_stream("dp", batch * world, kind=kind, grad_accum_steps=accum)
    else:
        reference = _reference(batch * world, accum)
    for result in results:
        _same_training(result, reference)


def test_streams_validation_inside_an_epoch_meets_the_training_stream_s_sums():
    """Validation every 3 steps starts its own sums while the training stream's next block
    is being summed: every rank starts them in the same order, and the values are exact."""
    results = run_on_ranks(
        functools.partial(train_stream, "ddp", 4, val_every_n_steps=3), world_size=2
    )
    reference = train_map_style(8, val_every_n_steps=3)
    for result in results:
        _same_training(result, reference)
        assert len(result["validations"]) == len(reference["validations"]) > 4
        for mine, theirs in zip(result["validations"], reference["validations"], strict=True):
            assert mine["step"] == theirs["step"]
            assert mine["val_acc"] == pytest.approx(theirs["val_acc"], abs=1e-12)


@pytest.mark.parametrize("world", [2, 3])
def test_streams_evaluation_counts_every_sample_once(world):
    results = run_on_ranks(functools.partial(census, "ddp", 61), world_size=world, timeout=120)
    expected = {"c_count": 61.0, "c_sum": float(sum(range(61))),
                "c_squares": float(sum(i * i for i in range(61)))}  # fmt: skip
    for scores in results:
        assert {key: scores[key] for key in expected} == expected


def test_streams_uneven_shards_stop_together_with_exact_weights():
    """A ShardedStream whose ranks hold 41 and 20 samples: rank 1 runs out after 5 steps,
    rank 0 trains 6 more; every rank stops at the same step, and each step is the mean over
    the samples the ranks had, as one process would compute it."""
    results = run_on_ranks(
        functools.partial(train_stream, "ddp", 4, kind="rank_shares"), world_size=2, timeout=120
    )
    expected = train_steps_by_hand(rank_share_steps(61, 4, 2))
    for result in results:
        assert result["steps"] == 2 * 11
        assert max_abs_diff(result["state"], expected) <= TOL


def test_streams_fsdp_trains_and_evaluates_a_stream_exactly():
    results = run_on_ranks(functools.partial(train_stream, "fsdp", 4), world_size=2, timeout=240)
    for result in results:
        _same_training(result, _reference(8))


@pytest.mark.parametrize("kind", ["samples", "rank_shares"])
def test_streams_resume_mid_stream_equals_an_uninterrupted_run(tmp_path, kind):
    common = {"kind": kind, "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2}
    whole = run_on_ranks(functools.partial(train_stream, "ddp", 4, kind=kind), world_size=2)
    run_on_ranks(functools.partial(train_stream, "ddp", 4, max_steps=10, **common), world_size=2)
    resumed = run_on_ranks(
        functools.partial(train_stream, "ddp", 4, resume="auto", **common), world_size=2
    )
    for mine, theirs in zip(resumed, whole, strict=True):
        assert mine["steps"] == theirs["steps"]
        assert max_abs_diff(mine["state"], theirs["state"]) <= TOL


def test_streams_resume_at_another_world_size_recuts_a_stream_distkit_shards(tmp_path):
    common = {"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2}
    run_on_ranks(functools.partial(train_stream, "ddp", 3, max_steps=6, **common), world_size=2)
    resumed = run_on_ranks(
        functools.partial(train_stream, "ddp", 2, resume="auto", **common), world_size=3
    )
    # 6 steps of 6 samples, then the rest of the epoch at 3 x 2: the same global batches
    assert max_abs_diff(resumed[0]["state"], _reference(6)["state"]) <= TOL


def test_streams_a_sharded_stream_refuses_a_mid_epoch_resume_at_another_world_size(tmp_path):
    common = {"kind": "rank_shares", "checkpoint_dir": str(tmp_path / "ckpt")}
    run_on_ranks(
        functools.partial(train_stream, "ddp", 4, max_steps=2, checkpoint_every=2, **common),
        world_size=2,
    )
    with pytest.raises(AssertionError, match="ShardedStream, at another number of processes"):
        run_on_ranks(
            functools.partial(train_stream, "ddp", 4, resume="auto", **common), world_size=3
        )


# ---------------------------------------------------------------------------- hostile input
def _fit(data, **trainer_args):
    trainer_args = {"batch_size": 4, "progress": False, **trainer_args}
    model = make_mlp(dtype=DTYPE)  # the streams' samples are float64
    with distkit.Trainer("dp", **trainer_args) as trainer:
        return trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data,
            loss_fn=nn.functional.cross_entropy,
        )  # fmt: skip


def test_streams_an_iterator_cannot_train_two_epochs():
    with pytest.raises(ConfigurationError, match="can be read once"):
        _fit(iter(BatchIterable(61)), max_epochs=2)
    assert len(_fit(iter(BatchIterable(61))).history) == 1  # one epoch is fine


def test_streams_an_empty_stream_is_refused():
    with pytest.raises(ConfigurationError, match="train_data has no data in epoch 0"):
        _fit(SampleStream(0))


def test_streams_batches_without_a_batch_dimension_are_refused():
    with pytest.raises(ConfigurationError, match="no samples that distkit can count"):
        _fit([("not", "tensors")] * 3 for _ in range(1))


def test_streams_drop_last_drops_the_partial_global_batch():
    whole = _fit(SampleStream(61), batch_size=8)
    dropped = _fit(SampleStream(61), batch_size=8, drop_last=True)
    assert whole.history[0]["train_loss"] != dropped.history[0]["train_loss"]
    with pytest.raises(ConfigurationError, match="drop_last=True dropped its first"):
        _fit(SampleStream(5), batch_size=8, drop_last=True)


def test_streams_a_dataloader_over_a_stream_keeps_its_batch_size():
    loader = DataLoader(SampleStream(61), batch_size=8)
    mine = _fit(loader, batch_size=3)
    theirs = _fit(make_dataset(61, dtype=DTYPE), batch_size=8, shuffle=False)
    assert mine.history[0]["train_loss"] == pytest.approx(theirs.history[0]["train_loss"], 1e-6)


def test_streams_sharded_stream_rejects_what_is_not_a_stream():
    with pytest.raises(ConfigurationError, match="map-style Dataset"):
        distkit.ShardedStream(make_dataset(4))
    with pytest.raises(ConfigurationError, match="takes an IterableDataset"):
        distkit.ShardedStream(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- real launchers
CENSUS = {"c_count": 61.0, "c_sum": float(sum(range(61))),
          "c_squares": float(sum(i * i for i in range(61)))}  # fmt: skip


def _launch(command: list[str], out, world: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_streams_under_torchrun_with_workers_end_together_and_evaluate_exactly(tmp_path, world):
    torchrun = Path(sys.executable).parent / "torchrun"
    results = _launch(
        [str(torchrun), "--standalone", "--nproc_per_node", str(world), "-m",
         "tests.support.job_scripts.stream_job", "ddp", "2", "2", str(tmp_path)],
        tmp_path, world,
    )  # fmt: skip
    for result in results:
        _same_training(result, _reference(2 * world))
        assert {key: result["census"][key] for key in CENSUS} == CENSUS


@needs_horovod
@pytest.mark.parametrize("world", [2, 3])
def test_streams_under_horovodrun_end_together_and_evaluate_exactly(tmp_path, world):
    results = _launch(
        [str(horovodrun_path()), "-np", str(world), "-H", f"localhost:{world}", "--gloo",
         sys.executable, "-m", "tests.support.job_scripts.stream_job", "horovod", "2", "0",
         str(tmp_path)],
        tmp_path, world,
    )  # fmt: skip
    for result in results:
        _same_training(result, _reference(2 * world))
        assert {key: result["census"][key] for key in CENSUS} == CENSUS


def test_streams_a_stream_that_differs_between_ranks_is_refused_on_every_rank():
    from tests.support.stream_workloads import fit_rank_dependent_stream

    errors = run_on_ranks(functools.partial(fit_rank_dependent_stream, "ddp"), world_size=2)
    for error in errors:
        assert error.startswith("ConfigurationError: train_data yields different data on")


def test_streams_a_stream_that_fails_on_one_rank_stops_every_rank():
    from tests.support.stream_workloads import fit_failing_stream

    errors = run_on_ranks(functools.partial(fit_failing_stream, "ddp"), world_size=2, timeout=90)
    assert errors[1] == "OSError: shard-0003.tar: unexpected end of data"
    assert errors[0].startswith("PeerFailureError") and "rank 1" in errors[0]


def _sums_kept_after_their_use() -> dict[str, object]:
    """Runs on every rank: 12 host-side sums whose results are dropped at once."""
    from distkit.strategies._torch_dist import KEEP_PENDING

    with distkit.Trainer("ddp", progress=False) as trainer:
        strategy = trainer.strategy
        results = [strategy.all_reduce_async(torch.ones(3), name="t").wait() for _ in range(12)]
        kept = strategy._recent_sums
        last_alive = kept[-1].wait() is not None and len(kept) == KEEP_PENDING
    cleared = strategy._recent_sums == ()
    return {"sums": [r.tolist() for r in results], "kept": last_alive, "cleared": cleared}


def test_streams_host_side_sums_are_freed_here_not_in_gloo_s_thread():
    """The last host-side sums stay referenced after their caller drops them, so their
    tensors are freed on the training thread, many sums later (a gloo thread freeing them
    takes the GIL, and on CPython <= 3.11.7 that can deadlock a DataLoader worker forked at
    that moment: python/cpython#112275; CI once hung at a stream's validation start)."""
    for result in run_on_ranks(_sums_kept_after_their_use, world_size=2):
        assert result["sums"] == [[2.0, 2.0, 2.0]] * 12
        assert result["kept"] and result["cleared"]
