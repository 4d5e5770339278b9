"""What a stream costs per step against the same data map-style: the end-of-data check.

A stream's steps carry one host-side sum over ranks each (how many samples every rank holds
for the next step, started a step ahead and read when that step begins). This script trains
the same small MLP on the same 8,192 samples three ways, alternating rounds so that machine
noise hits each alike, and prints the median time per step (distkit's own step timer: data,
forward, backward, all-reduce, optimizer) and the difference against map-style:

* ``map-style``: a TensorDataset (today's loop, every rank knows every share in advance);
* ``batches``: the same batches as an iterable of ready batches (the check, and little else);
* ``stream``: an IterableDataset of samples (the check, plus reading the whole stream on every
  rank and collating).

and the time of one table sum alone (the check itself: one per block of 4 steps), and of the
digest that tells whether every rank read the same items (each rank digests every sample of
every global micro-batch, its own and the other ranks', where it reads them; the digests ride
in the table): per step of this benchmark's samples, and per 3 x 224 x 224 float image, of
which it reads 4,096 values.

    python benchmarks/streams.py              # ddp x2 (gloo) and dp x1
    python benchmarks/streams.py --rounds 5

Writes benchmarks/results/streams.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import distkit

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLES, FEATURES, CLASSES, BATCH = 8192, 32, 10, 32


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(features, torch.randint(0, CLASSES, (SAMPLES,), generator=generator))


class _Samples(IterableDataset):
    def __iter__(self):
        features, labels = _data().tensors
        for i in range(SAMPLES):
            yield features[i], labels[i]


class _Batches:
    """Ready batches of the global batch size's share (world size x BATCH per batch)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __iter__(self):
        features, labels = _data().tensors
        for start in range(0, SAMPLES, BATCH):
            yield features[start : start + BATCH], labels[start : start + BATCH]


def _one_fit(kind: str, strategy: str) -> float:
    """Median-of-epoch time per step (ms) of the second epoch of one fit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with distkit.Trainer(strategy, batch_size=BATCH, max_epochs=2, progress=False,
                         shuffle=False) as trainer:  # fmt: skip
        data: Any = {"map-style": _data(), "stream": _Samples(),
                     "batches": _Batches(trainer.world_size)}[kind]  # fmt: skip
        result = trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    return float(result.history[-1]["time_step_ms"])


def _table_sum_us(strategy: str, repeats: int = 300) -> float:
    """One table sum alone, started and waited for back to back (no training to hide it
    behind: an upper bound of what a block costs), median in microseconds."""
    import time

    with distkit.Trainer(strategy, progress=False) as trainer:
        table = torch.zeros(trainer.world_size * 4, dtype=torch.int64)
        times = []
        for index in range(repeats):
            start = time.perf_counter()
            trainer.strategy.all_reduce_async(table, name=f"bench.{index}").wait()
            times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _digest_us(items: list[Any], repeats: int = 200) -> float:
    """Digesting ``items`` (one global micro-batch), median in microseconds."""
    import time

    from distkit.data._stream_share import ItemsDigest

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        digest = ItemsDigest()
        for item in items:
            digest.add(item)
        digest.value()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _digest_costs(world: int) -> dict[str, float]:
    features, labels = _data().tensors
    samples = [(features[i], labels[i]) for i in range(world * BATCH)]
    generator = torch.Generator().manual_seed(0)
    images = [(torch.rand(3, 224, 224, generator=generator), torch.tensor(i)) for i in range(8)]
    return {
        "digest_us_per_step": _digest_us(samples),
        "digest_us_per_image": _digest_us(images, repeats=50) / len(images),
    }


def _rounds(strategy: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"map-style": [], "batches": [], "stream": []}
    for _ in range(rounds):
        for kind in times:
            times[kind].append(_one_fit(kind, strategy))
    times["table sum us"] = [_table_sum_us(strategy)]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    table: dict[str, dict[str, float]] = {}
    runs = {
        "ddp x2": (2, lambda: distkit.spawn(_rounds, nprocs=2, args=("ddp", args.rounds))),
        "dp x1": (1, lambda: _rounds("dp", args.rounds)),
    }
    for label, (world, run) in runs.items():
        times = run()
        medians = {kind: statistics.median(values) for kind, values in times.items()}
        table[label] = medians
        one_sum = medians.pop("table sum us")
        digest = _digest_costs(world) if world > 1 else {}  # one process checks nothing
        table[label] = {**medians, "table_sum_us": one_sum, **digest}
        base = medians["map-style"]
        print(f"{label}: ms per step (median of {args.rounds} rounds)")
        for kind, value in medians.items():
            extra = "" if kind == "map-style" else (
                f"  {1000 * (value - base):+7.0f} us/step  ratio {value / base:.3f}")  # fmt: skip
            print(f"  {kind:10s} {value:7.3f}{extra}")
        print(
            f"  one table sum alone: {one_sum:.0f} us (a block of 4 steps: <= "
            f"{one_sum / 4:.0f} us/step, less where it overlaps training)"
        )
        if digest:
            print(
                f"  digest of the items read: {digest['digest_us_per_step']:.0f} us per step "
                f"({world} x {BATCH} samples), {digest['digest_us_per_image']:.0f} us per "
                "3x224x224 float image (in the DataLoader workers where there are some)"
            )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "streams.json").write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
