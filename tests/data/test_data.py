"""Sharding: global batch k is the same set of samples whatever the number of processes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from distkit.data import GlobalBatchPlan, LoaderSpec, ShardSampler
from distkit.data._collate import explained_collate
from distkit.errors import ConfigurationError

pytestmark = pytest.mark.timeout(60)

EPOCHS = (0, 1, 2)


def _plans(num_samples, batch_size, world_size, **kwargs):
    return [
        GlobalBatchPlan(
            num_samples, batch_size=batch_size, world_size=world_size, rank=rank, **kwargs
        )
        for rank in range(world_size)
    ]


def _single(num_samples, batch_size, world_size, **kwargs):
    return GlobalBatchPlan(
        num_samples, batch_size=batch_size * world_size, world_size=1, rank=0, **kwargs
    )


def _check_plan_invariants(num_samples, batch_size, world_size, grad_accum_steps, shuffle, drop):
    kwargs = {"grad_accum_steps": grad_accum_steps, "shuffle": shuffle, "drop_last": drop}
    plans = _plans(num_samples, batch_size, world_size, **kwargs)
    single = _single(num_samples, batch_size, world_size, **kwargs)
    assert {len(plan) for plan in plans} == {len(single)}

    micro = [list(plan.micro_batches()) for plan in plans]
    for epoch in EPOCHS:
        reference = single.order(epoch)
        for plan in plans:
            assert torch.equal(plan.order(epoch), reference)  # one permutation on every rank
        single_batches = list(single.local_batches(epoch))
        per_rank = [list(plan.local_batches(epoch)) for plan in plans]
        assert all(len(batches) == len(single_batches) for batches in per_rank)

        seen: list[int] = []
        for k, expected in enumerate(single_batches):
            union: list[int] = []
            for rank in range(world_size):
                indices = per_rank[rank][k]
                count = micro[rank][k].count
                if count == 0:
                    assert len(indices) == 1, "a rank with no sample gets one placeholder"
                    assert indices[0] in expected
                else:
                    assert len(indices) == count
                    union += indices
            assert len(union) == len(set(union)), f"batch {k} repeats a sample"
            assert set(union) == set(expected), f"epoch {epoch} batch {k}"
            counts = [micro[rank][k].count for rank in range(world_size)]
            assert max(counts) - min(counts) <= 1, "a short batch is split as evenly as it goes"
            seen += union

        assert len(seen) == len(set(seen)), "a sample appears twice in one epoch"
        if drop:
            global_batch = batch_size * world_size
            assert len(seen) == num_samples // global_batch * global_batch
            assert set(seen) <= set(range(num_samples))
        else:
            assert sorted(seen) == list(range(num_samples))


def _check_weights(num_samples, batch_size, world_size, grad_accum_steps, drop):
    kwargs = {"grad_accum_steps": grad_accum_steps, "drop_last": drop}
    plans = _plans(num_samples, batch_size, world_size, **kwargs)
    micro = [list(plan.micro_batches()) for plan in plans]
    batches = [list(plan.local_batches(0)) for plan in plans]
    num_micro = len(plans[0])
    expected_steps = [m // grad_accum_steps for m in range(num_micro)]
    expected_last = [
        m == num_micro - 1 or (m + 1) % grad_accum_steps == 0 for m in range(num_micro)
    ]
    # A made-up loss per sample: the weighted, rank-averaged micro-batch means must give the
    # mean over the samples of the optimizer step, as one process with the whole batch would.
    sample_loss = torch.rand(num_samples, dtype=torch.float64, generator=torch.Generator())
    for rank in range(world_size):
        assert [mb.step for mb in micro[rank]] == expected_steps
        assert [mb.last_in_step for mb in micro[rank]] == expected_last
        assert all(mb.weight == 0 for mb in micro[rank] if mb.count == 0)
        assert plans[rank].steps_per_epoch == expected_steps[-1] + 1
    for step in range(plans[0].steps_per_epoch):
        members = [m for m in range(num_micro) if expected_steps[m] == step]
        weight_sum = sum(micro[r][m].weight for r in range(world_size) for m in members)
        assert weight_sum == pytest.approx(world_size)
        averaged = (
            sum(
                micro[r][m].weight * sample_loss[batches[r][m]].mean().item()
                for r in range(world_size)
                for m in members
            )
            / world_size
        )
        step_samples = [
            i
            for r in range(world_size)
            for m in members
            if micro[r][m].count
            for i in batches[r][m]
        ]
        assert averaged == pytest.approx(sample_loss[step_samples].mean().item())


PLAN_CASES = [
    # (num_samples, batch_size, world_size, grad_accum_steps)
    (1, 1, 1, 1),
    (10, 3, 1, 2),
    (16, 4, 2, 1),
    (17, 4, 2, 1),
    (9, 4, 2, 2),  # last global batch of 1 sample: rank 1 gets a placeholder
    (7, 2, 3, 3),
    (5, 1, 5, 1),
    (23, 3, 4, 2),
    (100, 7, 3, 4),
    (3, 8, 3, 1),  # one short global batch, one sample per rank
]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("num_samples", "batch_size", "world_size", "accum"), PLAN_CASES)
def test_global_batch_plan_union_over_ranks_equals_single_process_batch(
    num_samples, batch_size, world_size, accum, shuffle, drop_last
):
    if drop_last and num_samples < batch_size * world_size:
        with pytest.raises(ConfigurationError, match="drop_last=True leaves no batch"):
            _plans(num_samples, batch_size, world_size, drop_last=True)
        return
    _check_plan_invariants(num_samples, batch_size, world_size, accum, shuffle, drop_last)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("num_samples", "batch_size", "world_size", "accum"), PLAN_CASES)
def test_global_batch_plan_weights_give_the_step_mean(
    num_samples, batch_size, world_size, accum, drop_last
):
    if drop_last and num_samples < batch_size * world_size:
        with pytest.raises(ConfigurationError, match="drop_last=True leaves no batch"):
            _plans(num_samples, batch_size, world_size, drop_last=True)
        return
    _check_weights(num_samples, batch_size, world_size, accum, drop_last)


@st.composite
def _plan_configs(draw):
    world_size = draw(st.integers(1, 5))
    batch_size = draw(st.integers(1, 6))
    num_samples = draw(st.integers(world_size, 60))
    accum = draw(st.integers(1, 4))
    shuffle = draw(st.booleans())
    drop = draw(st.booleans()) and num_samples >= batch_size * world_size
    return num_samples, batch_size, world_size, accum, shuffle, drop


@settings(max_examples=40, deadline=None)
@given(_plan_configs())
def test_global_batch_plan_invariants_hold_for_any_config(config):
    num_samples, batch_size, world_size, accum, shuffle, drop = config
    _check_plan_invariants(num_samples, batch_size, world_size, accum, shuffle, drop)
    _check_weights(num_samples, batch_size, world_size, accum, drop)


def test_global_batch_plan_shuffle_changes_order_every_epoch():
    plan = GlobalBatchPlan(50, batch_size=4, world_size=2, rank=1, shuffle=True)

    orders = [plan.order(epoch).tolist() for epoch in range(4)]
    batches = [list(plan.local_batches(epoch)) for epoch in range(4)]

    for a, b in itertools.combinations(range(4), 2):
        assert orders[a] != orders[b]
        assert batches[a] != batches[b]
    assert orders[0] != list(range(50))
    assert plan.order(1).tolist() == orders[1], "an epoch's order is reproducible"


def test_global_batch_plan_seed_changes_order():
    first = GlobalBatchPlan(50, batch_size=4, world_size=2, rank=0, seed=0)
    second = GlobalBatchPlan(50, batch_size=4, world_size=2, rank=0, seed=1)

    assert first.order(0).tolist() != second.order(0).tolist()


def test_global_batch_plan_without_shuffle_keeps_order_every_epoch():
    plan = GlobalBatchPlan(10, batch_size=2, world_size=2, rank=1, shuffle=False)

    assert list(plan.local_batches(0)) == [[1, 3], [5, 7], [9]]
    assert list(plan.local_batches(5)) == list(plan.local_batches(0))


def test_global_batch_plan_placeholder_for_rank_without_sample():
    # 9 samples, global batch 4 (2 ranks x 2): the last global batch is one sample.
    rank1 = GlobalBatchPlan(9, batch_size=2, world_size=2, rank=1, shuffle=False)

    assert list(rank1.local_batches(0)) == [[1, 3], [5, 7], [8]]
    last = list(rank1.micro_batches())[-1]
    assert (last.count, last.weight, last.last_in_step) == (0, 0.0, True)


def test_global_batch_plan_dataset_smaller_than_world_raises():
    with pytest.raises(ConfigurationError, match=r"3 sample\(s\) but there are 4 processes"):
        GlobalBatchPlan(3, batch_size=1, world_size=4, rank=0)


def test_global_batch_plan_drop_last_leaving_no_batch_raises():
    with pytest.raises(ConfigurationError, match="drop_last=True leaves no batch") as info:
        GlobalBatchPlan(7, batch_size=4, world_size=2, rank=0, drop_last=True)

    assert "7 samples" in str(info.value) and "global batch 8" in str(info.value)


@pytest.mark.parametrize(
    ("num_samples", "world_size"), [(7, 2), (8, 2), (10, 3), (2, 3), (1, 1), (100, 7)]
)
def test_shard_sampler_covers_each_index_once_without_padding(num_samples, world_size):
    shards = [
        list(ShardSampler(num_samples, world_size=world_size, rank=rank))
        for rank in range(world_size)
    ]

    assert sorted(itertools.chain(*shards)) == list(range(num_samples))
    lengths = [
        len(ShardSampler(num_samples, world_size=world_size, rank=r)) for r in range(world_size)
    ]
    assert lengths == [len(shard) for shard in shards]
    assert max(lengths) - min(lengths) <= 1


def test_shard_sampler_seven_samples_two_ranks():
    assert list(ShardSampler(7, world_size=2, rank=0)) == [0, 2, 4, 6]
    assert list(ShardSampler(7, world_size=2, rank=1)) == [1, 3, 5]


# ---------------------------------------------------------------------------- LoaderSpec


def _dataset(n=10):
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def _from_data(data, **overrides):
    kwargs = {
        "batch_size": 4,
        "shuffle": True,
        "num_workers": 0,
        "pin_memory": False,
        "what": "train_data",
    }
    return LoaderSpec.from_data(data, **{**kwargs, **overrides})


def _collate(samples):
    return samples


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


class _Empty(Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, index):
        raise IndexError(index)


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_spec_from_dataset_uses_given_settings(shuffle):
    dataset = _dataset()

    spec = _from_data(dataset, batch_size=3, shuffle=shuffle)

    assert spec.dataset is dataset
    assert (spec.batch_size, spec.shuffle, spec.drop_last) == (3, shuffle, False)
    assert spec.kwargs == {"num_workers": 0, "pin_memory": False, "collate_fn": explained_collate}
    assert len(spec) == 10


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_spec_from_dataloader_takes_its_own_settings(shuffle):
    dataset = _dataset()
    loader = DataLoader(dataset, batch_size=5, shuffle=shuffle, collate_fn=_collate)

    spec = _from_data(loader, batch_size=32, shuffle=not shuffle)

    assert spec.dataset is dataset
    assert (spec.batch_size, spec.shuffle, spec.drop_last) == (5, shuffle, False)
    assert spec.kwargs["collate_fn"] is _collate


def test_loader_spec_from_dataloader_keeps_drop_last():
    spec = _from_data(DataLoader(_dataset(), batch_size=3, drop_last=True))

    assert spec.drop_last is True


@pytest.mark.parametrize(
    ("make_loader", "field"),
    [
        (
            lambda ds: DataLoader(
                ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * len(ds), len(ds))
            ),
            "sampler",
        ),
        (
            lambda ds: DataLoader(
                ds, batch_sampler=BatchSampler(SequentialSampler(ds), 2, drop_last=False)
            ),
            "batch_sampler",
        ),
        (
            lambda ds: DataLoader(
                ds, batch_size=2, sampler=RandomSampler(ds, replacement=True, num_samples=4)
            ),
            "sampler",
        ),
    ],
    ids=["weighted-sampler", "batch-sampler", "replacement"],
)
def test_loader_spec_from_dataloader_keeps_a_users_sampler_to_draw_on_every_rank(
    make_loader, field
):
    loader = make_loader(_dataset())

    spec = _from_data(loader)

    expected = loader.sampler if field == "sampler" else loader.batch_sampler
    assert getattr(spec, field) is expected  # see tests/data/test_samplers.py


@pytest.mark.parametrize(
    ("make_loader", "words"),
    [
        (
            lambda ds: DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 2, 0)),
            ["DistributedSampler", "not needed"],
        ),
        (
            lambda ds: DataLoader(ds, batch_size=None),
            ["batch_size=None", "automatic batching off"],
        ),
    ],
    ids=["distributed-sampler", "no-batching"],
)
def test_loader_spec_from_dataloader_refuses_samplers_it_cannot_shard(make_loader, words):
    with pytest.raises(ConfigurationError) as info:
        _from_data(make_loader(_dataset()))

    message = str(info.value)
    assert "train_data" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (_Stream(), ["no length", "_Stream", "map-style"]),
        (DataLoader(_Stream(), batch_size=2), ["no length", "_Stream", "map-style"]),
        (_Empty(), ["empty", "0 samples"]),
        (DataLoader(_Empty(), batch_size=2), ["empty", "0 samples"]),
        (42, ["must be a torch Dataset", "DataLoader", "int"]),
        (None, ["must be a torch Dataset", "NoneType"]),
    ],
    ids=["iterable", "iterable-loader", "empty", "empty-loader", "int", "none"],
)
def test_loader_spec_from_data_refuses_unshardable_data(data, words):
    with pytest.raises(ConfigurationError) as info:
        _from_data(data, what="val_data")

    message = str(info.value)
    assert "val_data" in message
    for word in words:
        assert word in message


def test_loader_spec_from_data_accepts_plain_sequence():
    spec = _from_data([(torch.zeros(2), 0)] * 6)

    assert len(spec) == 6


def _collect(spec, plan, epochs, num_workers):
    loader, sampler = spec.train_loader(plan, seed=3)
    assert loader.num_workers == num_workers
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out.append([(x.clone(), y.clone()) for x, y in loader])
    return out


@pytest.mark.timeout(60)
def test_loader_spec_train_loader_workers_yield_the_same_batches():
    dataset = _dataset(23)
    plan = GlobalBatchPlan(23, batch_size=3, world_size=2, rank=1, shuffle=True, seed=3)
    epochs = (0, 1)

    serial = _collect(_from_data(dataset, batch_size=3, num_workers=0), plan, epochs, 0)
    parallel = _collect(_from_data(dataset, batch_size=3, num_workers=2), plan, epochs, 2)

    for epoch, batches in zip(epochs, serial, strict=True):
        expected = list(plan.local_batches(epoch))
        assert [y.tolist() for _, y in batches] == expected
    for serial_epoch, parallel_epoch in zip(serial, parallel, strict=True):
        assert len(serial_epoch) == len(parallel_epoch)
        for (xs, ys), (xp, yp) in zip(serial_epoch, parallel_epoch, strict=True):
            assert torch.equal(xs, xp) and torch.equal(ys, yp)
    assert [y.tolist() for _, y in serial[0]] != [y.tolist() for _, y in serial[1]]


def test_loader_spec_eval_loader_shards_without_padding():
    spec = _from_data(_dataset(7), batch_size=2, shuffle=True)

    shards = [
        [y.tolist() for _, y in spec.eval_loader(world_size=2, rank=rank, seed=0)]
        for rank in range(2)
    ]

    assert shards == [[[0, 2], [4, 6]], [[1, 3], [5]]]
