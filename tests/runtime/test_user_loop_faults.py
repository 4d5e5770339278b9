"""A user's own loop inside ``with distkit.Runtime(...)`` fails fast: an error on one rank
stops every rank within seconds (the others raise PeerFailureError naming it), the user's own
handlers run, and a Trainer's fit nested in the block reports a failure once. Real gloo
processes."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import PeerFailureError, RankDisagreementError
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(300)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def loop_failing_on(fail_rank: int) -> dict[str, Any]:
    """Rank ``fail_rank`` raises at its third batch; the other goes on to its next
    backward (a gradient all-reduce that would wait for the failed rank forever)."""
    seen: dict[str, Any] = {}
    start = time.monotonic()
    rt = None
    try:
        with distkit.Runtime("ddp", fault_timeout=10.0) as rt:
            model = make_mlp()
            model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for i, (x, y) in enumerate(rt.loader(make_dataset(80), batch_size=4)):
                if rt.rank == fail_rank and i == 2:
                    raise KeyError("missing column 'label'")
                rt.backward(_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    except PeerFailureError as exc:
        seen.update(kind="peer", failed_rank=exc.failed_rank, text=str(exc))
    except KeyError as exc:
        seen.update(kind="own", text=str(exc))
    seen["seconds"] = time.monotonic() - start
    seen["closed"] = rt is not None and rt.closed
    return seen


def test_an_error_in_one_ranks_loop_stops_every_rank(run_on_ranks):
    own, peer = run_on_ranks(loop_failing_on, 1, world_size=2)[::-1]
    assert own["kind"] == "own" and "missing column" in own["text"]
    assert peer["kind"] == "peer" and peer["failed_rank"] == 1, peer
    assert "KeyError" in peer["text"]
    assert own["closed"] and peer["closed"]
    # within the fault timeout, not the collective's 30 minutes (a generous bound)
    assert peer["seconds"] < 120


def fit_failing_inside_the_block(fail_rank: int) -> dict[str, Any]:
    """A Trainer fit on the block's Runtime fails on one rank; each rank catches the fit's
    error inside the block and leaves it normally."""
    seen: dict[str, Any] = {}
    with distkit.Runtime("ddp", fault_timeout=10.0) as rt:
        calls = {"n": 0}

        def step_fn(m: nn.Module, batch: Any) -> torch.Tensor:
            calls["n"] += 1
            if rt.rank == fail_rank and calls["n"] == 2:
                raise KeyError("missing column 'label'")
            x, y = batch
            return _loss(m(x), y)

        model = make_mlp()
        trainer = distkit.Trainer(runtime=rt, batch_size=4, max_epochs=1, progress=False)
        try:
            trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(40),
                        step_fn=step_fn)  # fmt: skip
        except PeerFailureError as exc:
            seen.update(kind="peer", failed_rank=exc.failed_rank)
        except KeyError:
            seen.update(kind="own")
    seen["closed"] = rt.closed
    return seen


def test_a_fit_failing_inside_a_runtime_block_is_reported_once(run_on_ranks):
    """The fit's guard told the peers and closed the Runtime; the block's guard lets the
    caught error be (no second notice, no error at the block's end)."""
    results = run_on_ranks(fit_failing_inside_the_block, 0, world_size=2)
    assert results[0] == {"kind": "own", "closed": True}
    assert results[1] == {"kind": "peer", "failed_rank": 0, "closed": True}


def loader_on_rank_zero_only() -> str:
    """The loop under ``if rt.is_main:`` (rank 0 trains alone) while rank 1 goes on to the
    barrier after it: every rank fails at once, naming both calls."""
    with distkit.Runtime("ddp", fault_timeout=10.0) as rt:
        model = make_mlp()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = rt.loader(make_dataset(16), batch_size=4)
        try:
            if rt.is_main:
                for x, y in loader:
                    rt.backward(_loss(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
            rt.barrier()
        except RankDisagreementError as exc:
            return str(exc)
    return "no error"


def test_a_loader_iterated_on_one_rank_only_fails_every_rank(run_on_ranks):
    for error in run_on_ranks(loader_on_rank_zero_only, world_size=2):
        assert "rank 0 in an epoch of rt.loader" in error, error
        assert "rank 1 in rt.barrier" in error, error


def epochs_apart() -> str:
    """Rank 1 skips an epoch (``loader.epoch(1)``): refused at the first batch, naming it."""
    with distkit.Runtime("ddp", fault_timeout=10.0) as rt:
        loader = rt.loader(make_dataset(16), batch_size=4)
        try:
            for _ in loader.epoch(rt.rank):
                break
        except RankDisagreementError as exc:
            return str(exc)
    return "no error"


def test_ranks_iterating_other_epochs_are_refused(run_on_ranks):
    for error in run_on_ranks(epochs_apart, world_size=2):
        assert "epoch: rank 0: 0; rank 1: 1" in error, error
        assert "the same epochs in the same order" in error, error
