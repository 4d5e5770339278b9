"""Every rank reads the same stream (issue 24): a stream distkit shards whose ranks read other
items (an unseeded shuffle) is refused on every rank, naming where they first differ; one
shuffled alike everywhere still trains exactly like one process. Real gloo processes."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

import distkit
from distkit.data._stream_share import ItemsDigest
from distkit.errors import ConfigurationError
from tests.support.exactness import DTYPE, TOL
from tests.support.host_syncs import StepSpans, counting
from tests.support.multiprocess import run_on_ranks
from tests.support.paths import ROOT
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)

N = 61  # samples: the last global batch is partial


class UnseededShuffle(IterableDataset):
    """Shuffles with a generator seeded from the OS, as ``np.random.default_rng()`` is: another
    order on every rank (and in every DataLoader worker)."""

    def __iter__(self):
        data = make_dataset(N, dtype=DTYPE)
        for i in np.random.default_rng().permutation(N).tolist():
            yield data[i]


class EpochSeededShuffle(IterableDataset):
    """The fix the error names: a generator seeded from the epoch, the same on every rank."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        data = make_dataset(N, dtype=DTYPE)
        for i in np.random.default_rng((7, self.epoch)).permutation(N).tolist():
            yield data[i]


class OneItemDiffers(IterableDataset):
    """The workload in order, except that where ``differs`` the item at ``position`` is the
    next sample (so that rank's stream holds one sample twice)."""

    def __init__(self, position: int, differs: bool) -> None:
        self.position, self.differs = position, differs

    def __iter__(self):
        data = make_dataset(N, dtype=DTYPE)
        for i in range(N):
            yield data[i + 1 if self.differs and i == self.position else i]


class Batches:
    """An iterable of ready batches of 4 (no Dataset: read in the main process), in order or
    in an order drawn per rank (``shuffle_seed``: the rank, as an unseeded shuffle would differ
    by rank; seeded so that the first batches differ on every run: two unseeded shuffles of 16
    batches agree on their first 2 once in 240 runs, and the refusal then names batches 2-3)."""

    def __init__(self, shuffle_seed: int | None) -> None:
        self.shuffle_seed = shuffle_seed

    def __iter__(self):
        features, labels = make_dataset(N, dtype=DTYPE).tensors
        starts = list(range(0, N, 4))
        if self.shuffle_seed is not None:
            random.Random(f"rank {self.shuffle_seed}").shuffle(starts)
        for start in starts:
            yield features[start : start + 4], labels[start : start + 4]


def _stream(kind: str, rank: int) -> Any:
    if kind == "unseeded":
        return UnseededShuffle()
    if kind.startswith("batches"):
        return Batches(shuffle_seed=rank if kind == "batches-unseeded" else None)
    if kind == "seeded":
        return EpochSeededShuffle()
    if kind.startswith("differs@"):  # differs@<rank>:<position>
        where, position = kind.removeprefix("differs@").split(":")
        return OneItemDiffers(int(position), differs=rank == int(where))
    raise ValueError(kind)


def fit_stream(
    kind: str, batch_size: int, *, strategy: str = "ddp", num_workers: int = 0, val: bool = False
) -> dict[str, Any]:
    """Train two epochs on ``_stream(kind)`` (validating on it too with ``val``); the final
    weights, or the error as ``"Type: message"``."""
    trainer = distkit.Trainer(
        strategy,
        batch_size=batch_size,
        max_epochs=2,
        seed=3,
        num_workers=num_workers,
        progress=False,
    )
    with trainer:
        net = make_mlp(dtype=DTYPE)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        train = _stream("seeded" if val else kind, trainer.rank)
        try:
            result = trainer.fit(
                net,
                opt,
                train,
                loss_fn=nn.functional.cross_entropy,
                val_data=_stream(kind, trainer.rank) if val else None,
            )
        except ConfigurationError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "state": trainer.full_state_dict(),
            "steps": trainer.global_step,
            "losses": [record["train_loss"] for record in result.history],
        }


def evaluate_stream(kind: str) -> str:
    with distkit.Trainer("ddp", batch_size=4, progress=False) as trainer:
        try:
            trainer.evaluate(
                make_mlp(dtype=DTYPE),
                _stream(kind, trainer.rank),
                loss_fn=nn.functional.cross_entropy,
            )
        except ConfigurationError as exc:
            return f"{type(exc).__name__}: {exc}"
    return "evaluated"


def on_ranks(kind: str, batch_size: int, workers: int, tmp_path: Path) -> list[dict[str, Any]]:
    """``fit_stream`` on 2 ranks: forked processes, or under torchrun where DataLoader workers
    read the stream (a forked test rank is a daemon, which may not start workers)."""
    if not workers:
        return run_on_ranks(functools.partial(fit_stream, kind, batch_size), world_size=2)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "tests.data.test_stream_agreement",
        kind,
        str(batch_size),
        str(workers),
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def _refused_alike(results: list[dict[str, Any]]) -> str:
    """The error every rank raised (the same message on every rank)."""
    errors = [result.get("error") for result in results]
    assert all(errors), errors  # before the check, every rank trained
    assert len(set(errors)) == 1, errors
    return errors[0]


# ---------------------------------------------------------------------------- refused
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_agreement_an_unseeded_shuffle_is_refused_on_every_rank(workers, tmp_path):
    """The issue's case: np.random.default_rng() per pass trained 17 of 64 samples twice and
    17 never, silently. Now the first global micro-batch already differs, and every rank says
    so alike, with the likely cause and both fixes (with workers, each worker digests the
    global micro-batches it reads, and the digest travels with its batch)."""
    results = on_ranks("unseeded", 4, workers, tmp_path)
    error = _refused_alike(results)
    assert error.startswith(
        "ConfigurationError: train_data yields different data on different ranks (epoch 0, "
        "samples 0 to 7 of the stream, its global micro-batch 0: rank(s) [1] read other items "
        "there than rank 0)"
    ), error
    assert "np.random.default_rng()" in error and "seed" in error
    assert "distkit.ShardedStream" in error


def test_stream_agreement_one_differing_item_on_one_rank_is_named():
    """Rank 1's stream holds sample 38 where the others hold sample 37: the global
    micro-batch of samples 32..39 (the second block of 4 steps) is named, the first 32
    samples agree."""
    results = run_on_ranks(functools.partial(fit_stream, "differs@1:37", 4), world_size=2)
    error = _refused_alike(results)
    where = (
        "(epoch 0, samples 32 to 39 of the stream, its global micro-batch 4: rank(s) [1] "
        "read other items there than rank 0)"
    )
    assert where in error, error


def test_stream_agreement_an_item_another_rank_keeps_is_compared_too():
    """Every rank reads the whole stream, so the digest covers every rank's share of a
    global micro-batch: on 3 ranks, rank 1 differing in sample 2 (rank 2's to train, not its
    own) is seen."""
    results = run_on_ranks(functools.partial(fit_stream, "differs@1:2", 2), world_size=3)
    error = _refused_alike(results)
    where = (
        "(epoch 0, samples 0 to 5 of the stream, its global micro-batch 0: rank(s) [1] "
        "read other items there than rank 0)"
    )
    assert where in error, error


def test_stream_agreement_an_iterable_of_batches_read_in_the_main_process_is_checked():
    """Batch i of an iterable of batches goes to rank i % N: in order it trains (8 steps of
    2 batches an epoch); in an order drawn per rank it is refused at its first 2 batches."""
    for result in run_on_ranks(functools.partial(fit_stream, "batches", 4), world_size=2):
        assert result.get("steps") == 2 * 8, result.get("error")
    results = run_on_ranks(functools.partial(fit_stream, "batches-unseeded", 4), world_size=2)
    error = _refused_alike(results)
    where = (
        "(epoch 0, batches 0 to 1 of the stream, its global micro-batch 0: rank(s) [1] "
        "read other items there than rank 0)"
    )
    assert where in error, error


def test_stream_agreement_a_validation_stream_is_checked_alike():
    results = run_on_ranks(functools.partial(fit_stream, "unseeded", 4, val=True), world_size=2)
    error = _refused_alike(results)
    start = "val_data yields different data on different ranks (samples 0 to 7 of the stream"
    assert error.startswith(f"ConfigurationError: {start}"), error
    for error in run_on_ranks(functools.partial(evaluate_stream, "unseeded"), world_size=2):
        assert error.startswith("ConfigurationError: val_data yields different data"), error


# ---------------------------------------------------------------------------- still exact
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_agreement_a_shuffle_seeded_from_the_epoch_trains_like_one_process(
    workers, tmp_path
):
    reference = fit_stream("seeded", 8, strategy="dp")
    results = on_ranks("seeded", 4, workers, tmp_path)
    for result in results:
        assert "error" not in result, result["error"]
        assert result["steps"] == reference["steps"] == 2 * 8
        assert max_abs_diff(result["state"], reference["state"]) <= TOL
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOL)


# ---------------------------------------------------------------------------- no host sync
def stream_reads_per_step() -> list[list[str]]:
    """Host reads filed by step while 2 ranks train 16 steps of a stream (blocks of 4)."""
    spans = StepSpans()
    with distkit.Trainer(
        "ddp", batch_size=2, max_epochs=1, progress=False, callbacks=[spans]
    ) as trainer:
        net, stream = make_mlp(dtype=DTYPE), _stream("seeded", trainer.rank)
        with counting(spans):
            trainer.fit(
                net,
                torch.optim.SGD(net.parameters(), lr=0.1),
                stream,
                loss_fn=nn.functional.cross_entropy,
            )
    return spans.spans


def test_stream_agreement_the_digests_ride_the_block_sum_with_no_read_per_step():
    """The digests travel in the counts' table, one sum per block of 4 steps: the steps
    inside a block read nothing on the host (the default log interval, 50, is not reached),
    and a block's reads are the table and the digest of CPU items, in the stream's modules."""
    for spans in run_on_ranks(stream_reads_per_step, world_size=2):
        assert len(spans) == 16 + 1  # ceil(61 / 4) = 16 steps
        inside = {k: spans[k] for k in range(1, 16) if k % 4 and spans[k]}
        assert inside == {}, inside
        at_blocks = [read for k in range(4, 16, 4) for read in spans[k]]
        assert at_blocks and all("_stream_" in read for read in at_blocks), at_blocks


# ---------------------------------------------------------------------------- the digest
def _digest(*items: Any) -> int:
    digest = ItemsDigest()
    for item in items:
        digest.add(item)
    return digest.value()


def test_stream_agreement_digest_sees_order_values_shapes_and_types():
    x, y = torch.arange(6.0), torch.tensor(1)
    same = _digest((x, y), (x + 1, y))
    assert same == _digest((x.clone(), y.clone()), (x + 1, y.clone())) > 0
    assert same != _digest((x + 1, y), (x, y))  # order
    assert same != _digest((x, y), (x + 1, torch.tensor(2)))  # a value
    assert same != _digest((x.reshape(2, 3), y), (x + 1, y))  # a shape
    assert same != _digest((x.double(), y), (x + 1, y))  # a dtype
    assert _digest({"a": 1, "b": "k"}) != _digest({"a": 1, "b": "l"})
    assert _digest([1, 2.0, None, True]) != _digest([1, 2, None, True])
    assert _digest(np.arange(4)) != _digest(np.arange(4)[::-1])
    assert _digest(b"abc", np.float32(1.5)) == _digest(b"abc", np.float32(1.5))


def test_stream_agreement_digest_of_a_large_tensor_is_bounded_and_still_sees_a_swap():
    """A 3 x 512 x 512 image is digested by 4096 elements spread over it (and its shape):
    a strided view digests like its contiguous copy, two images of a shuffle differ."""
    images = torch.rand(2, 3, 512, 512)
    assert _digest(images[0]) != _digest(images[1])
    hwc = images[0].permute(1, 2, 0)
    assert _digest(hwc) == _digest(hwc.contiguous())
    array = hwc.numpy()
    assert _digest(array) == _digest(np.ascontiguousarray(array))
    assert _digest(array) != _digest(images[1].permute(1, 2, 0).numpy())


def test_stream_agreement_digest_reads_no_device_tensor_and_no_address():
    """A tensor off the CPU counts by dtype and shape (reading it would synchronise the
    device); an object whose repr holds its address counts by its type."""
    meta = torch.empty(3, 4, device="meta")
    assert _digest(meta) == _digest(torch.empty(3, 4, device="meta"))
    assert _digest(meta) != _digest(torch.empty(4, 3, device="meta"))
    assert _digest(object()) == _digest(object())


if __name__ == "__main__":  # torchrun -m tests.data.test_stream_agreement KIND BATCH WORKERS OUT
    _result = fit_stream(sys.argv[1], int(sys.argv[2]), num_workers=int(sys.argv[3]))
    torch.save(_result, Path(sys.argv[4]) / f"rank{os.environ['RANK']}.pt")
