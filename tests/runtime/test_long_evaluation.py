"""An evaluation over a stream that goes on and on says so on rank 0 (an endless stream
never ends one, and nothing can tell it from a long one in advance)."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

import distkit
from distkit.data import _eval_rounds
from tests.support.workloads import make_dataset, make_mlp

pytestmark = [pytest.mark.timeout(120)]


class _SlowStream(IterableDataset):
    """24 samples, one every 20 ms: a stream that seems to go on."""

    def __iter__(self):
        for sample in make_dataset(24):
            time.sleep(0.02)
            yield sample


def _evaluate() -> list[str]:
    trainer = distkit.Trainer("dp", batch_size=4, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = trainer.evaluate(make_mlp(), _SlowStream(), loss_fn=nn.functional.cross_entropy)
    assert torch.isfinite(torch.tensor(scores["loss"]))
    return [str(w.message) for w in caught if "evaluating a stream" in str(w.message)]


def test_long_evaluation_of_a_stream_asks_once_whether_it_ends(monkeypatch):
    monkeypatch.setattr(_eval_rounds, "LONG_EVALUATION_S", 0.1)
    said = _evaluate()
    assert len(said) == 1, said
    assert "an endless stream never ends an evaluation" in said[0]
    assert "itertools.islice(stream, n)" in said[0]


def test_short_evaluation_of_a_stream_says_nothing():
    assert _evaluate() == []
