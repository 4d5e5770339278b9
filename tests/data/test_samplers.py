"""A user's sampler or batch sampler: drawn alike on every rank, sharded exactly.

N processes with batch b train as one process with batch N*b (a sampler), or as one process
accumulating N of the batch sampler's batches per step (a batch sampler).
"""

from __future__ import annotations

import os
import random
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

import distkit
from distkit import checkpoint as ckpt
from distkit.data import GlobalBatchPlan, LoaderSpec
from distkit.data._batch_plan import batch_plan
from distkit.data._samplers import BatchSamplerPlan, SamplerPlan, draw
from distkit.errors import ConfigurationError
from distkit.trainer import _resume
from tests.support.exactness import DTYPE, TOL
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff, without_timing

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- samplers of every kind
class _Recording(Sampler[int]):
    """Yields a permutation from the global RNG; records the epochs it was set to."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class _PythonAndNumpy(Sampler[int]):
    """Draws from Python's and numpy's global RNGs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        order = list(range(self.n))
        random.shuffle(order)
        return iter(np.random.permutation(order).tolist())

    def __len__(self) -> int:
        return self.n


class _Lying(Sampler[int]):
    """len() says 6, iteration gives 5."""

    def __iter__(self):
        return iter(range(5))

    def __len__(self) -> int:
        return 6


class _NoLen(Sampler[Any]):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


class _Fixed(Sampler[Any]):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class _RankSeeded(Sampler[int]):
    """A sampler that (wrongly) draws its own order on each rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        generator = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


class _ShardsByRank(Sampler[int]):
    """A third-party distributed sampler: it says whose part it yields."""

    def __init__(self, n: int) -> None:
        self.n, self.num_replicas, self.rank = n, 2, 0

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


class LengthBuckets(Sampler[list[int]]):
    """Length bucketing: samples sorted by length, cut into batches of at most ``max_tokens``
    padded tokens (so short samples come in big batches), the batches shuffled with the
    global RNG every epoch."""

    def __init__(self, lengths: list[int], max_tokens: int) -> None:
        batches: list[list[int]] = [[]]
        for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
            if batches[-1] and (len(batches[-1]) + 1) * lengths[i] > max_tokens:
                batches.append([])
            batches[-1].append(i)
        self.batches = batches

    def __iter__(self):
        for k in torch.randperm(len(self.batches)).tolist():
            yield list(self.batches[k])

    def __len__(self) -> int:
        return len(self.batches)


class Pairs(Sampler[list[int]]):
    """Each two consecutive batches of another batch sampler as one batch."""

    def __init__(self, batches: Sampler[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        drawn = list(self.batches)
        for k in range(0, len(drawn), 2):
            yield [i for batch in drawn[k : k + 2] for i in batch]

    def __len__(self) -> int:
        return (len(self.batches) + 1) // 2  # type: ignore[arg-type]


def _weights(n: int) -> list[float]:
    return [1.0 + (i % 5) for i in range(n)]


# ---------------------------------------------------------------- a sampler's plan
@pytest.mark.parametrize(("world", "batch", "accum"), [(2, 3, 1), (3, 2, 2), (4, 1, 3)])
def test_sampler_plan_union_over_ranks_equals_single_process_batch(world, batch, accum):
    sampler = WeightedRandomSampler(_weights(20), num_samples=29)  # 29: a short last batch
    plans = [
        SamplerPlan(sampler, batch_size=batch, world_size=world, rank=r, grad_accum_steps=accum)
        for r in range(world)
    ]
    single = SamplerPlan(sampler, batch_size=batch * world, world_size=1, rank=0)
    for epoch in (0, 1):
        order = single.order(epoch).tolist()
        assert len(order) == 29 and len(set(order)) < 29, "drawn with replacement"
        assert all(torch.equal(plan.order(epoch), single.order(epoch)) for plan in plans)
        assert len({plan.fingerprint(epoch) for plan in plans}) == 1
        expected = list(single.local_batches(epoch))
        per_rank = [list(plan.local_batches(epoch)) for plan in plans]
        micro = [list(plan.micro_batches(0, epoch)) for plan in plans]
        for k, batch_k in enumerate(expected):
            union = [i for r in range(world) if micro[r][k].count for i in per_rank[r][k]]
            assert sorted(union) == sorted(batch_k)
    assert single.order(0).tolist() != single.order(1).tolist()
    assert single.fingerprint(0) != single.fingerprint(1)


def test_sampler_plan_draw_leaves_global_rngs_and_the_users_generator_alone():
    generator = torch.Generator().manual_seed(5)
    sampler = WeightedRandomSampler(_weights(30), 30, generator=generator)
    before = generator.get_state()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = (torch.rand(3), random.random(), np.random.rand())

    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    SamplerPlan(sampler, batch_size=2, world_size=2, rank=0).order(0)
    SamplerPlan(_PythonAndNumpy(30), batch_size=2, world_size=2, rank=0).order(0)

    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]
    assert torch.equal(generator.get_state(), before)


def test_sampler_plan_order_depends_on_seed_epoch_and_users_seed_only():
    def order(seed=0, epoch=0, user_seed=5, sampler_type=WeightedRandomSampler):
        generator = torch.Generator().manual_seed(user_seed)
        if sampler_type is WeightedRandomSampler:
            sampler: Sampler[int] = WeightedRandomSampler(_weights(30), 30, generator=generator)
        else:
            sampler = sampler_type(30)
        plan = SamplerPlan(sampler, batch_size=2, world_size=2, rank=0, seed=seed)
        return plan.order(epoch).tolist()

    torch.manual_seed(123), random.seed(123), np.random.seed(123)  # the global state: no matter
    assert order() == order(), "a resumed run (a new plan) redraws the same order"
    assert order() != order(seed=1)
    assert order() != order(epoch=1)
    assert order() != order(user_seed=6), "the user's generator seed still counts"
    for kind in (_Recording, _PythonAndNumpy):
        first = order(sampler_type=kind)
        torch.manual_seed(7), random.seed(7), np.random.seed(7)
        assert order(sampler_type=kind) == first
        assert order(sampler_type=kind, epoch=1) != first


def test_sampler_plan_draws_once_per_epoch_after_set_epoch():
    sampler = _Recording(12)
    plan = SamplerPlan(sampler, batch_size=2, world_size=2, rank=1)

    for epoch in (0, 1):
        plan.fingerprint(epoch)
        list(plan.local_batches(epoch))
        list(plan.micro_batches(0, epoch))

    assert sampler.epochs == [0, 1]


def test_sampler_plan_takes_len_of_sampler_as_the_epoch():
    sampler = SubsetRandomSampler([3, 5, 7, 9, 11])
    plan = SamplerPlan(sampler, batch_size=2, world_size=2, rank=0)

    assert (plan.num_samples, len(plan), plan.samples_per_epoch) == (5, 2, 5)
    assert sorted(plan.order(0).tolist()) == [3, 5, 7, 9, 11]
    assert "sampler=SubsetRandomSampler (5 per epoch)" in plan.describe()


@pytest.mark.parametrize(
    ("sampler", "words"),
    [
        (_Lying(), ["_Lying yielded 5 indices", "len() is 6", "__len__"]),
        (_NoLen([0, 1]), ["_NoLen has no len()", "__len__"]),
        (_Fixed([]), ["_Fixed is empty"]),
        (_Fixed(["a", "b"]), ["yielded 'a' (str)", "integer indices"]),
        (_Fixed([0]), ["1 sample(s) but there are 2 processes"]),
    ],
    ids=["len-differs", "no-len", "empty", "not-indices", "fewer-than-ranks"],
)
def test_sampler_plan_refuses_a_sampler_it_cannot_plan(sampler, words):
    with pytest.raises(ConfigurationError) as info:
        SamplerPlan(sampler, batch_size=2, world_size=2, rank=0).local_batches(0).__next__()

    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------- a batch sampler's plan
_BATCHES = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]


def _batch_plans(batches, world, **kwargs):
    return [
        BatchSamplerPlan(_Fixed(batches), world_size=world, rank=r, **kwargs) for r in range(world)
    ]


def test_batch_sampler_plan_gives_each_rank_whole_batches_in_turn():
    plans = _batch_plans(_BATCHES, 2)

    assert [list(plan.local_batches(0)) for plan in plans] == [
        [[0, 1, 2], [4, 5], [10]],
        [[3], [6, 7, 8, 9], [10]],  # no 6th batch: a placeholder
    ]
    micro = [list(plan.micro_batches(0, 0)) for plan in plans]
    rank0 = [(m.count, m.samples, m.weight) for m in micro[0]]
    rank1 = [(m.count, m.samples, m.weight) for m in micro[1]]
    assert rank0 == [(3, 4, 1.5), (2, 6, 2 / 3), (1, 1, 2.0)]
    assert rank1 == [(1, 4, 0.5), (4, 6, 4 / 3), (0, 1, 0.0)]
    assert all(m.last_in_step for m in micro[0])
    assert (len(plans[0]), plans[0].steps_per_epoch, plans[0].samples_per_epoch) == (3, 3, None)
    assert plans[0].order(0).tolist() == list(range(11))


@pytest.mark.parametrize(("world", "accum"), [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (6, 1)])
def test_batch_sampler_plan_weights_give_the_step_mean(world, accum):
    plans = _batch_plans(_BATCHES, world, grad_accum_steps=accum)
    sample_loss = torch.rand(11, dtype=torch.float64, generator=torch.Generator())
    micro = [list(plan.micro_batches(0, 0)) for plan in plans]
    batches = [list(plan.local_batches(0)) for plan in plans]
    # one process accumulating world * accum batches per step
    steps = [_BATCHES[k : k + world * accum] for k in range(0, len(_BATCHES), world * accum)]
    assert plans[0].steps_per_epoch == len(steps)
    for step, members in enumerate(steps):
        indices = [m for m in range(len(micro[0])) if micro[0][m].step == step]
        assert len(indices) == -(-len(members) // world)
        averaged = sum(
            micro[r][m].weight * sample_loss[batches[r][m]].mean().item()
            for r in range(world)
            for m in indices
        )
        expected = sample_loss[[i for batch in members for i in batch]].mean().item()
        assert averaged / world == pytest.approx(expected)


def test_batch_sampler_plan_drop_last_drops_a_short_last_group():
    plans = _batch_plans(_BATCHES, 2, drop_last=True)

    assert len(plans[0]) == 2
    assert list(plans[1].local_batches(0)) == [[3], [6, 7, 8, 9]]
    with pytest.raises(ConfigurationError, match="drop_last=True leaves no batch"):
        _batch_plans(_BATCHES, 6, drop_last=True)


def test_batch_sampler_plan_resumes_at_a_global_micro_batch_boundary():
    plan = _batch_plans(_BATCHES, 2)[1]

    assert plan.remaining(4, epoch=0) == 2
    assert list(plan.local_batches(0, start=4)) == [[6, 7, 8, 9], [10]]
    assert plan.remaining(11, epoch=0) == 0, "a checkpoint at the end of the epoch"
    with pytest.raises(ConfigurationError) as info:
        plan.remaining(5, epoch=0)
    assert "sample position 5 is not where a global micro-batch" in str(info.value)
    assert "(0, 4, 10, 11)" in str(info.value)


def test_batch_sampler_plan_draws_seeded_by_the_epoch():
    buckets = LengthBuckets([1 + i % 4 for i in range(40)], max_tokens=12)
    plans = [BatchSamplerPlan(buckets, world_size=2, rank=r, seed=3) for r in range(2)]

    torch.manual_seed(0)
    first = [list(plan.local_batches(0)) for plan in plans]
    torch.manual_seed(1)
    again = BatchSamplerPlan(buckets, world_size=2, rank=0, seed=3)

    assert list(again.local_batches(0)) == first[0]
    assert plans[0].fingerprint(0) == plans[1].fingerprint(0) == again.fingerprint(0)
    assert list(again.local_batches(1)) != first[0]
    counts = [[m.count for m in plan.micro_batches(0, 0)] for plan in plans]
    covered = sorted(
        i
        for rank, batches in enumerate(first)
        for k, batch in enumerate(batches)
        if counts[rank][k]  # not a placeholder
        for i in batch
    )
    assert covered == list(range(40))


@pytest.mark.parametrize(
    ("batches", "words"),
    [
        (_NoLen([[0]]), ["batch_sampler _NoLen has no len()", "__len__"]),
        (_Fixed([]), ["batch_sampler _Fixed is empty", "at least one batch"]),
        (_Fixed([[0, 1], []]), ["yielded an empty batch (batch 1 of epoch 0)"]),
    ],
    ids=["no-len", "empty", "empty-batch"],
)
def test_batch_sampler_plan_refuses_a_batch_sampler_it_cannot_plan(batches, words):
    with pytest.raises(ConfigurationError) as info:
        BatchSamplerPlan(batches, world_size=2, rank=0).remaining(0, epoch=0)

    for word in words:
        assert word in str(info.value)


def test_batch_sampler_plan_refuses_a_len_that_differs_from_its_batches():
    class _Short(_Fixed):
        def __len__(self) -> int:
            return 3

    plan = BatchSamplerPlan(_Short([[0], [1]]), world_size=2, rank=0)

    with pytest.raises(ConfigurationError, match=r"_Short yielded 2 batches in epoch 0 but its"):
        plan.fingerprint(0)


def test_draw_calls_set_epoch_and_reseeds_a_batch_samplers_generator():
    generator = torch.Generator().manual_seed(9)
    inner = RandomSampler(range(20), generator=generator)
    batches = BatchSampler(inner, 4, drop_last=False)
    before = generator.get_state()

    first = draw(batches, seed=1, epoch=2)

    assert first == draw(batches, seed=1, epoch=2)
    assert first != draw(batches, seed=1, epoch=3)
    assert torch.equal(generator.get_state(), before)
    assert batches.sampler is inner


# ---------------------------------------------------------------- LoaderSpec and the loader
def _dataset(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def _spec(loader: DataLoader[Any], what: str = "train_data") -> LoaderSpec:
    return LoaderSpec.from_data(
        loader, batch_size=99, shuffle=True, num_workers=0, pin_memory=False, what=what
    )


def _collate(samples):
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


class _ReplacementRandom(RandomSampler):
    """A subclass: it may draw otherwise, so it is the user's sampler."""


@pytest.mark.parametrize(
    "make_sampler",
    [
        lambda ds: WeightedRandomSampler(_weights(len(ds)), 7),
        lambda ds: RandomSampler(ds, replacement=True, num_samples=4),
        lambda ds: RandomSampler(ds, num_samples=15),
        lambda ds: _ReplacementRandom(ds),
        lambda ds: SubsetRandomSampler([1, 2, 3]),
    ],
    ids=["weighted", "replacement", "num-samples", "subclass", "subset"],
)
def test_loader_spec_keeps_a_users_sampler(make_sampler):
    dataset = _dataset()
    sampler = make_sampler(dataset)

    spec = _spec(DataLoader(dataset, batch_size=3, sampler=sampler, drop_last=True))

    assert (spec.sampler, spec.batch_sampler) == (sampler, None)
    assert (spec.batch_size, spec.shuffle, spec.drop_last) == (3, False, True)


@pytest.mark.parametrize(("shuffle", "kind"), [(True, RandomSampler), (False, SequentialSampler)])
def test_loader_spec_plain_shuffle_keeps_distkits_own_permutation(shuffle, kind):
    loader = DataLoader(_dataset(), batch_size=3, shuffle=shuffle)
    assert type(loader.sampler) is kind

    spec = _spec(loader)

    assert (spec.sampler, spec.batch_sampler, spec.shuffle) == (None, None, shuffle)


def test_loader_spec_keeps_a_users_batch_sampler_and_loader_settings():
    batches = BatchSampler(SequentialSampler(range(10)), 4, drop_last=False)

    spec = _spec(DataLoader(_dataset(), batch_sampler=batches, collate_fn=_collate))

    assert (spec.batch_sampler, spec.sampler) == (batches, None)
    assert spec.batch_size == 4, "evaluation batches take the batch sampler's batch_size"
    assert spec.kwargs["collate_fn"] is _collate
    other = _spec(DataLoader(_dataset(), batch_sampler=_Fixed([[0], [1, 2]])))
    assert other.batch_size == 1


@pytest.mark.parametrize(
    "make_loader",
    [
        lambda ds: DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 2, 0)),
        lambda ds: DataLoader(
            ds, batch_sampler=BatchSampler(DistributedSampler(ds, 2, 1), 2, drop_last=False)
        ),
        lambda ds: DataLoader(ds, batch_size=2, sampler=_ShardsByRank(len(ds))),
    ],
    ids=["distributed", "distributed-in-batch-sampler", "shards-by-rank"],
)
@pytest.mark.parametrize("what", ["train_data", "val_data"])
def test_loader_spec_refuses_a_sampler_that_shards_by_rank(make_loader, what):
    with pytest.raises(ConfigurationError) as info:
        _spec(make_loader(_dataset()), what)

    message = str(info.value)
    assert f"{what} uses a " in message
    assert "gives each process its own part" in message
    assert "DistributedSampler is not needed" in message


def test_loader_spec_refuses_a_loader_without_automatic_batching():
    with pytest.raises(ConfigurationError, match=r"batch_size=None \(automatic batching off\)"):
        _spec(DataLoader(_dataset(), batch_size=None))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_spec_train_loader_yields_the_batch_sampler_plans_batches(num_workers):
    dataset = _dataset(11)
    user = DataLoader(
        dataset, batch_sampler=_Fixed(_BATCHES), collate_fn=_collate, num_workers=num_workers
    )
    spec = _spec(user)
    plan = BatchSamplerPlan(spec.batch_sampler, world_size=2, rank=1)

    loader, sampler = spec.train_loader(plan, seed=3)
    sampler.set_epoch(0, 4)

    assert loader.num_workers == num_workers and len(sampler) == 2
    assert [y.tolist() for _, y in loader] == [[6, 7, 8, 9], [10]]


_PLACE = {"world_size": 2, "rank": 1, "grad_accum_steps": 2, "seed": 4, "drop_last": False}


@pytest.mark.parametrize(
    ("loader", "kind"),
    [
        (DataLoader(_dataset(), batch_size=2, shuffle=True), GlobalBatchPlan),
        (DataLoader(_dataset(), batch_size=2, sampler=SubsetRandomSampler([1, 2])), SamplerPlan),
        (DataLoader(_dataset(), batch_sampler=_Fixed(_BATCHES)), BatchSamplerPlan),
    ],
    ids=["shuffle", "sampler", "batch-sampler"],
)
def test_batch_plan_follows_the_loaders_sampling(loader, kind):
    plan = batch_plan(_spec(loader), **_PLACE)

    assert type(plan) is kind
    assert (plan.world_size, plan.rank, plan.grad_accum_steps, plan.seed) == (2, 1, 2, 4)


def test_check_fits_bounds_a_position_by_the_samplers_epoch():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    payload = {
        "model": model.state_dict(),
        "progress": {"epoch": 0, "position": 24, "train_samples": 20},
    }
    found = _resume.LoadedCheckpoint("step-3.pt (step 3)", payload)

    _resume.check_fits(found, model, optimizer, 20, 29)  # a sampler drawing 29 per epoch
    _resume.check_fits(found, model, optimizer, 20, None)  # a batch sampler's: its plan checks
    with pytest.raises(ConfigurationError, match=r"after 24 of 20 samples; train_data has 20 \("):
        _resume.check_fits(found, model, optimizer, 20, 22)
    with pytest.raises(ConfigurationError, match="train_data has 21"):
        _resume.check_fits(found, model, optimizer, 21, 29)


# ---------------------------------------------------------------- training on real processes
def _weighted_loader(n: int, batch: int, generator: bool) -> DataLoader[Any]:
    seeded = torch.Generator().manual_seed(7) if generator else None
    sampler = WeightedRandomSampler(_weights(n), num_samples=53, generator=seeded)
    return DataLoader(make_dataset(n, dtype=DTYPE), batch_size=batch, sampler=sampler)


def _fit_weighted(
    batch: int, accum: int = 1, generator: bool = False, dropout: bool = False, **trainer: Any
) -> dict:
    """2 epochs of a weighted sampler drawing 53 of 40 samples (a short last batch), in
    float64 (tests/support/exactness.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    model = model.to(DTYPE)
    if not dropout:  # dropout masks differ with the number of processes
        model = make_mlp(dtype=DTYPE)
    run = distkit.Trainer(
        "ddp", batch_size=batch, grad_accum_steps=accum, max_epochs=2, seed=3, progress=False,
        **trainer,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = _weighted_loader(40, batch, generator)
    result = run.fit(model, optimizer, loader, loss_fn=nn.functional.cross_entropy)
    out = {"state": run.full_state_dict(), "history": result.history}
    run.close()
    return out


@pytest.mark.parametrize(
    ("world", "batch", "accum", "generator"),
    [(2, 6, 1, False), (3, 4, 1, True), (2, 3, 2, False)],
    ids=["2x6", "3x4-own-generator", "2x3-accumulated"],
)
def test_weighted_sampler_n_processes_equal_one_with_the_global_batch(
    world, batch, accum, generator, run_on_ranks
):
    many = run_on_ranks(_fit_weighted, batch, accum, generator, world_size=world)
    one = run_on_ranks(_fit_weighted, 12, 1, generator, world_size=1)[0]

    assert max_abs_diff(many[0]["state"], one["state"]) <= TOL
    assert all(max_abs_diff(r["state"], many[0]["state"]) == 0.0 for r in many)
    for a, b in zip(many[0]["history"], one["history"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=TOL)


def _token_data(n: int = 37) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    generator = torch.Generator().manual_seed(2)
    lengths = [1 + int(v) for v in torch.randint(0, 6, (n,), generator=generator)]
    sequences = [torch.randn(length, 6, generator=generator).to(DTYPE) for length in lengths]
    labels = torch.tensor([int(s.sum() > 0) + (len(s) > 3) for s in sequences])
    return sequences, labels, lengths


class Sequences(Dataset):
    def __init__(self) -> None:
        self.sequences, self.labels, self.lengths = _token_data()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.sequences[index], self.labels[index]


def pad(samples):
    """Pads a batch to its longest sequence, with a mask of the real steps."""
    longest = max(len(seq) for seq, _ in samples)
    padded = torch.zeros(len(samples), longest, 6, dtype=DTYPE)
    mask = torch.zeros(len(samples), longest, dtype=DTYPE)
    for k, (seq, _) in enumerate(samples):
        padded[k, : len(seq)], mask[k, : len(seq)] = seq, 1.0
    return {"x": padded, "mask": mask, "y": torch.stack([y for _, y in samples])}


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.step = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.to(DTYPE)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.step(x)) * mask.unsqueeze(-1)
        return self.head(hidden.sum(dim=1) / mask.sum(dim=1, keepdim=True))


def _pooled_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"], batch["mask"]), batch["y"])


def _fit_buckets(accum: int, pairs: bool = False, **trainer: Any) -> dict:
    """2 epochs over 37 sequences in length buckets (an odd number of batches)."""
    dataset = Sequences()
    buckets = LengthBuckets(dataset.lengths, max_tokens=14)
    assert len(buckets) % 2 == 1, "a last group with one batch: a placeholder on rank 1"
    batches: Sampler[list[int]] = Pairs(buckets) if pairs else buckets
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=pad)
    model = Pooled()
    run = distkit.Trainer(
        "ddp", batch_size=1, grad_accum_steps=accum, max_epochs=2, seed=5, progress=False,
        **trainer,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    result = run.fit(model, optimizer, loader, step_fn=_pooled_loss)
    out = {"state": run.full_state_dict(), "history": result.history}
    run.close()
    return out


def test_length_buckets_two_processes_equal_one_accumulating_two(run_on_ranks):
    two = run_on_ranks(_fit_buckets, 1, world_size=2)
    accumulated = run_on_ranks(_fit_buckets, 2, world_size=1)[0]
    paired = run_on_ranks(partial(_fit_buckets, pairs=True), 1, world_size=1)[0]

    assert max_abs_diff(two[0]["state"], two[1]["state"]) == 0.0
    assert max_abs_diff(two[0]["state"], accumulated["state"]) <= TOL
    assert max_abs_diff(two[0]["state"], paired["state"]) <= TOL
    for a, b in zip(two[0]["history"], accumulated["history"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=TOL)


@pytest.mark.timeout(120)  # three 2-process runs
@pytest.mark.parametrize("kind", ["weighted", "buckets"])
def test_user_sampler_resume_mid_epoch_equals_an_uninterrupted_run(kind, tmp_path, run_on_ranks):
    # dropout on: the sampler's draws must not move the training's random streams
    weighted = partial(_fit_weighted, 4, dropout=True)
    train = weighted if kind == "weighted" else partial(_fit_buckets, 1)
    whole = run_on_ranks(train, world_size=2)[0]
    folder = str(tmp_path / "ckpt")
    run_on_ranks(
        partial(train, checkpoint_dir=folder, checkpoint_every=3, max_steps=3), world_size=2
    )
    saved = ckpt.load(ckpt.CheckpointFolder(folder).latest())["progress"]
    assert saved["epoch"] == 0 and saved["position"] > 0

    resumed = run_on_ranks(partial(train, checkpoint_dir=folder, resume="auto"), world_size=2)[0]

    assert max_abs_diff(resumed["state"], whole["state"]) <= TOL
    assert without_timing(resumed["history"]) == without_timing(whole["history"])


def _fit_rank_seeded() -> str:
    trainer = distkit.Trainer("ddp", batch_size=2, max_epochs=1, progress=False)
    loader = DataLoader(make_dataset(12), batch_size=2, sampler=_RankSeeded(12))
    model = make_mlp()
    try:
        trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
            loss_fn=nn.functional.cross_entropy,
        )  # fmt: skip
    except ConfigurationError as exc:
        return str(exc)
    finally:
        trainer.close()
    return "trained"


def test_sampler_drawing_per_rank_is_refused_on_every_rank(run_on_ranks):
    messages = run_on_ranks(_fit_rank_seeded, world_size=2)

    for message in messages:
        assert "drew a different order on rank(s) [1] than on rank 0 in epoch 0" in message


@pytest.mark.parametrize(
    ("make_loader", "phrase"),
    [
        (
            lambda ds: DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 1, 0)),
            "uses a DistributedSampler",
        ),
        (
            lambda ds: DataLoader(ds, batch_sampler=_NoLen([[0, 1], [2, 3]])),
            "batch_sampler _NoLen has no len()",
        ),
        (lambda ds: DataLoader(ds, batch_sampler=_Fixed([])), "batch_sampler _Fixed is empty"),
        (lambda ds: DataLoader(ds, batch_size=2, sampler=_Lying()), "_Lying yielded 5 indices"),
    ],
    ids=["distributed", "batch-sampler-without-len", "empty-batch-sampler", "len-differs"],
)
def test_fit_refuses_a_hostile_sampler_before_training(make_loader, phrase):
    trainer = distkit.Trainer("dp", batch_size=2, progress=False)
    model = make_mlp()

    def never(model: nn.Module, batch: Any) -> torch.Tensor:
        raise AssertionError("a training step ran before the bad sampler was reported")

    with pytest.raises(ConfigurationError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        trainer.fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(make_dataset(8)),
            step_fn=never,
        )  # fmt: skip
    trainer.close()
