"""Where each rank's evaluation samples sit in the data's order, for the three ways data is
sharded (pure: every rank's batch sizes in, every rank's positions out)."""

from __future__ import annotations

import pytest

from distkit.data._sample_order import SampleOrder, sample_positions

pytestmark = pytest.mark.timeout(30)


def _lists(order: SampleOrder, counts: list[list[int]]) -> list[list[int]]:
    return [p.tolist() for p in sample_positions(order, counts)]


def test_sample_positions_interleave_sample_by_sample_for_a_dataset():
    # 10 samples at 3 ranks, batch 2: the shards r, r + 3, ...
    assert _lists(SampleOrder.SAMPLES, [[2, 2], [2, 1], [2, 1]]) == [
        [0, 3, 6, 9],
        [1, 4, 7],
        [2, 5, 8],
    ]


def test_sample_positions_interleave_batch_by_batch_for_an_iterable_of_batches():
    # batches of 3, 2, 4, 1 samples: batch i on rank i % 3
    assert _lists(SampleOrder.BATCHES, [[3, 1], [2], [4]]) == [
        [0, 1, 2, 9],
        [3, 4],
        [5, 6, 7, 8],
    ]


def test_sample_positions_go_rank_by_rank_for_a_sharded_stream():
    assert _lists(SampleOrder.RANKS, [[2], [], [3, 1]]) == [[0, 1], [], [2, 3, 4, 5]]


@pytest.mark.parametrize("order", list(SampleOrder))
def test_sample_positions_cover_every_sample_once(order):
    counts = [[4, 4], [4, 4], [4, 3]] if order is SampleOrder.SAMPLES else [[5, 1], [2, 7], [3]]
    every = sorted(p for rank in _lists(order, counts) for p in rank)
    assert every == list(range(sum(map(sum, counts))))
