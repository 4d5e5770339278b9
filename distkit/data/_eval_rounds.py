"""The batches an evaluation reads on each rank: its shard's, counted, then spare ones.

Every rank must run as many forward passes as the rank with the most (a backend may hold a
collective in each), so a rank that runs out first goes on with spare batches that are not
counted: one-sample batches of a map-style dataset, a stream's latest batch again.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

from distkit.data._stream_feed import StreamFeed
from distkit.strategies.base import Strategy


def map_rounds(strategy: Strategy, loader: Any) -> Iterator[tuple[Any, bool]]:
    """A shard's batches (counted), then spare one-sample batches (not counted) up to
    :meth:`~distkit.Strategy.eval_rounds` passes."""
    rounds = strategy.eval_rounds(len(loader))
    done = 0
    for batch in loader:
        done += 1
        yield batch, True
    if done < rounds:
        spare = loader.collate_fn([loader.dataset[0]])
        for _ in range(rounds - done):
            yield spare, False


#: seconds one evaluation of a stream may run before rank 0 asks whether the stream ends
LONG_EVALUATION_S = 600.0


def stream_rounds(feed: StreamFeed, *, announce: bool) -> Iterator[tuple[Any, bool]]:
    """A stream's batches for this rank; every rank runs as many forward passes as the one
    with the most (it cannot know in advance which backends need that), spare ones (a
    rank's latest batch again) not counted.

    An endless stream never ends an evaluation, and nothing can tell it from a long one in
    advance: after ``LONG_EVALUATION_S`` seconds rank 0 (``announce``) says so, once.
    """
    start, samples, asked = time.monotonic(), 0, not announce
    for batch, micro in feed.epoch(0, 0, feed.seed):
        samples += micro.count
        if not asked and time.monotonic() - start > LONG_EVALUATION_S:
            asked = True
            warnings.warn(
                f"evaluating a stream has read {samples} samples on rank 0 in "
                f"{time.monotonic() - start:.0f} s and goes on: an endless stream never ends "
                "an evaluation (val_data or evaluate's data). Pass a finite one, e.g. "
                "itertools.islice(stream, n), or a map-style Dataset",
                stacklevel=2,
            )
        yield batch, micro.count > 0
