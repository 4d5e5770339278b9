"""Streams and trainings the stream tests run in-process, on gloo ranks and under horovodrun.

Every sample carries its index, so an evaluation can prove that it saw each sample exactly
once (:class:`SampleCensus`), and a training can be compared with the same data map-style.
Model and data are float64 (tests/support/exactness.py): a stream against map-style, ranks
against one process, within 1e-9 on any CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import distkit
from distkit.metrics import Metric
from tests.support.exactness import DTYPE
from tests.support.workloads import make_dataset, make_mlp


class SampleStream(IterableDataset):
    """``(features, label)`` of the shared workload, in order (``shuffle``: a permutation drawn
    from torch's global generator each pass, as a naive stream would); float64 unless
    ``dtype`` says otherwise."""

    def __init__(self, n: int = 61, *, shuffle: bool = False, dtype: torch.dtype = DTYPE) -> None:
        self.n, self.shuffle, self.dtype = n, shuffle, dtype
        self.passes = 0

    def __iter__(self):
        data = make_dataset(self.n, dtype=self.dtype)
        order = torch.randperm(self.n) if self.shuffle else torch.arange(self.n)
        self.passes += 1
        for i in order.tolist():
            yield data[i]


class SeekableStream(SampleStream):
    """A stream that can start at a sample: ``iter_from`` records where it was asked to."""

    def __init__(self, n: int = 61) -> None:
        super().__init__(n)
        self.seeks: list[int] = []

    def iter_from(self, position: int):
        self.seeks.append(position)
        data = make_dataset(self.n, dtype=self.dtype)
        for i in range(position, self.n):
            yield data[i]


class BatchIterable:
    """An iterable of ready batches (no Dataset): ``size`` samples each, the last one short."""

    def __init__(self, n: int = 61, size: int = 4) -> None:
        self.n, self.size = n, size

    def __iter__(self):
        features, labels = make_dataset(self.n, dtype=DTYPE).tensors
        for start in range(0, self.n, self.size):
            yield features[start : start + self.size], labels[start : start + self.size]


class IndexedStream(IterableDataset):
    """``(index, index)`` pairs for the census: the model's output is ignored."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(i)


class SampleCensus(Metric):
    """How many targets were seen, their sum and sum of squares (exact-once check)."""

    def batch_state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t = target.double()
        return torch.stack([torch.tensor(float(t.numel()), dtype=torch.float64), t.sum(),
                            (t * t).sum()])  # fmt: skip

    def state_shape(self) -> tuple[int, ...]:
        return (3,)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        count, total, squares = state.tolist()
        return {"count": count, "sum": total, "squares": squares}


def census(strategy: str, n: int, *, batch_size: int = 4) -> dict[str, float]:
    """Evaluate ``IndexedStream(n)`` (exact-once census) on whatever ranks run this."""
    with distkit.Trainer(strategy, batch_size=batch_size, progress=False) as trainer:
        return trainer.evaluate(nn.Identity(), IndexedStream(n), metrics={"c": SampleCensus()})


def make_stream(kind: str, n: int, rank: int) -> Any:
    if kind == "samples":
        return SampleStream(n)
    if kind == "shuffled":
        return SampleStream(n, shuffle=True)
    if kind == "batches":
        return BatchIterable(n, size=4)
    if kind == "rank_shares":  # rank r holds every sample i with i % 3 == r, plus rank 0 more
        data = make_dataset(n, dtype=DTYPE)
        mine = [data[i] for i in range(n) if i % 3 == rank or (rank == 0 and i % 3 == 2)]
        return distkit.ShardedStream(_ListStream(mine))
    raise ValueError(kind)


class _ListStream(IterableDataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def train_stream(
    strategy: str,
    batch_size: int,
    *,
    kind: str = "samples",
    n: int = 61,
    epochs: int = 2,
    grad_accum_steps: int = 1,
    num_workers: int = 0,
    max_steps: int | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | str = "epoch",
    resume: str | None = None,
    seed: int = 3,
    val_every_n_steps: int | None = None,
) -> dict[str, Any]:
    """Train the shared workload from a stream; final weights, history, validations."""
    trainer = distkit.Trainer(
        strategy, val_every_n_steps=val_every_n_steps, batch_size=batch_size,
        max_epochs=epochs, grad_accum_steps=grad_accum_steps,
        num_workers=num_workers, progress=False, seed=seed, max_steps=max_steps,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
    )  # fmt: skip
    with trainer:
        net = make_mlp(dtype=DTYPE)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        stream = make_stream(kind, n, trainer.rank)
        result = trainer.fit(
            net, opt, stream, loss_fn=nn.functional.cross_entropy,
            val_data=make_stream(kind, n, trainer.rank),
            metrics={"acc": distkit.Accuracy()},
        )  # fmt: skip
        return {
            "state": trainer.full_state_dict(),
            "history": result.history,
            "steps": trainer.global_step,
            "validations": result.validations,
            "rank": trainer.rank,
            "world_size": trainer.world_size,
        }


def train_map_style(
    batch_size: int,
    *,
    n: int = 61,
    epochs: int = 2,
    grad_accum_steps: int = 1,
    val_every_n_steps: int | None = None,
) -> dict[str, Any]:
    """The same training, map-style and unshuffled, on one process (the reference)."""
    trainer = distkit.Trainer(
        "dp", val_every_n_steps=val_every_n_steps, batch_size=batch_size,
        max_epochs=epochs, grad_accum_steps=grad_accum_steps,
        shuffle=False, progress=False, seed=3,
    )  # fmt: skip
    with trainer:
        net = make_mlp(dtype=DTYPE)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        data = make_dataset(n, dtype=DTYPE)
        result = trainer.fit(
            net, opt, data, loss_fn=nn.functional.cross_entropy, val_data=data,
            metrics={"acc": distkit.Accuracy()},
        )  # fmt: skip
        return {"state": trainer.full_state_dict(), "history": result.history,
                "steps": trainer.global_step, "validations": result.validations}  # fmt: skip


def rank_share_steps(n: int, batch_size: int, world: int) -> list[TensorDataset]:
    """What one process trains per step for ``make_stream("rank_shares", ...)`` on ``world``
    ranks: step t is every rank's t-th local batch together."""
    data = make_dataset(n, dtype=DTYPE)
    shares = [
        [data[i] for i in range(n) if i % 3 == r or (r == 0 and i % 3 == 2)] for r in range(world)
    ]
    steps = []
    t = 0
    while True:
        parts = [s[t * batch_size : (t + 1) * batch_size] for s in shares]
        items = [item for part in parts for item in part]
        if not items:
            return steps
        steps.append(
            TensorDataset(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))
        )
        t += 1


def train_steps_by_hand(steps: list[TensorDataset], epochs: int = 2) -> dict[str, torch.Tensor]:
    """One process, one optimizer step per given batch (mean loss over its samples)."""
    torch.manual_seed(3)
    net = make_mlp(dtype=DTYPE)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(epochs):
        for batch in steps:
            x, y = batch.tensors
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def save_result(result: dict[str, Any], out: Path) -> None:
    torch.save(result, out / f"rank{result['rank']}.pt")


def fit_rank_dependent_stream(strategy: str) -> str:
    """A stream that yields more on rank 1 than on rank 0 (a rank-seeded length): the error."""
    with distkit.Trainer(strategy, batch_size=4, progress=False) as trainer:
        net = make_mlp(dtype=DTYPE)
        stream = SampleStream(30 + 7 * trainer.rank)
        try:
            trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), stream,
                        loss_fn=nn.functional.cross_entropy)  # fmt: skip
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "trained"


class FailingStream(SampleStream):
    """Rank 1's stream raises after a few samples (a corrupt shard)."""

    def __init__(self, rank: int) -> None:
        super().__init__(61)
        self.rank = rank

    def __iter__(self):
        for index, item in enumerate(super().__iter__()):
            if self.rank == 1 and index == 20:
                raise OSError("shard-0003.tar: unexpected end of data")
            yield item


def fit_failing_stream(strategy: str) -> str:
    with distkit.Trainer(strategy, batch_size=4, progress=False, fault_timeout=10) as trainer:
        net = make_mlp(dtype=DTYPE)
        try:
            stream = FailingStream(trainer.rank)
            trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), stream,
                        loss_fn=nn.functional.cross_entropy)  # fmt: skip
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "trained"
