"""A collective called on one rank only from inside ``fit`` fails every rank at once.

Before, ``save_checkpoint`` or ``evaluate`` called on rank 0 only from a callback met the
other rank's stop check (or log point) and both waited until the collective timeout, which
then failed with a raw gloo error. Now the collectives between fit's steps and the first of
every agreement are one tagged sum: both ranks raise ``RankDisagreementError`` naming the
two calls within seconds. Real 2-rank gloo processes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.support.workloads import make_dataset, make_mlp

pytestmark = [pytest.mark.timeout(240)]
#: the collective timeout of these runs: a pairing that hangs fails the test's time bound
TIMEOUT = 60.0


class _OnRankZero(distkit.Callback):
    """Calls ``what`` from ``hook`` on rank 0 only (or on every rank: ``everywhere``)."""

    def __init__(self, hook: str, what: str, folder: str, everywhere: bool = False) -> None:
        self.hook, self.what, self.folder, self.everywhere = hook, what, folder, everywhere
        self.calls = 0

    def _maybe(self, trainer: distkit.Trainer) -> None:
        if not (trainer.is_main or self.everywhere) or self.calls:
            return
        self.calls += 1
        if self.what == "save_checkpoint":
            trainer.save_checkpoint(f"{self.folder}/from-callback.pt")
        else:
            trainer.evaluate(trainer._run.model, make_dataset(20), loss_fn=_loss)

    def on_epoch_end(self, trainer, record):
        if self.hook == "on_epoch_end":
            self._maybe(trainer)

    def on_train_step_end(self, trainer, logs):
        if self.hook == "on_train_step_end" and logs["step"] == 3:
            self._maybe(trainer)


class _StopNever(distkit.Callback):
    """A callback that may stop after any step: every step ends in a stop check."""

    def on_train_step_end(self, trainer, logs):
        pass


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def _fit(callbacks: list[distkit.Callback], **kwargs: Any) -> dict[str, Any]:
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=2, progress=False,
                              collective_timeout=TIMEOUT, callbacks=callbacks,
                              **kwargs)  # fmt: skip
    net = make_mlp()
    start = time.monotonic()
    try:
        trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), make_dataset(40),
                    loss_fn=_loss)  # fmt: skip
        return {"error": None, "type": None, "seconds": time.monotonic() - start}
    except Exception as exc:
        return {"error": str(exc), "type": type(exc).__name__,
                "seconds": time.monotonic() - start}  # fmt: skip
    finally:
        trainer.close()


def _one_rank(hook: str, what: str, folder: str, stop_each_step: bool = False) -> dict:
    callbacks: list[distkit.Callback] = [_OnRankZero(hook, what, folder)]
    if stop_each_step:
        callbacks.append(_StopNever())
    return _fit(callbacks)


@pytest.mark.parametrize(
    ("hook", "what", "stop_each_step", "other"),
    [
        ("on_epoch_end", "save_checkpoint", False, "fit's"),
        ("on_epoch_end", "evaluate", False, "fit's"),
        ("on_train_step_end", "save_checkpoint", True, "fit's"),
        ("on_train_step_end", "evaluate", True, "fit's"),
    ],
)
def test_one_rank_collective_inside_fit_fails_every_rank_naming_both_calls(
    hook, what, stop_each_step, other, tmp_path, run_on_ranks
):
    results = run_on_ranks(_one_rank, hook, what, str(tmp_path), stop_each_step, world_size=2)
    for rank, result in enumerate(results):
        assert result["type"] == "RankDisagreementError", (rank, result)
        assert f"rank 0 in {what}" in result["error"], result["error"]
        assert f"rank 1 in {other}" in result["error"], result["error"]
        assert "from callbacks only where every rank calls them" in result["error"]
        assert result["seconds"] < TIMEOUT / 2, result  # at once, not at the timeout
    assert results[0]["error"] == results[1]["error"]


def _everywhere(folder: str) -> dict:
    return _fit([_OnRankZero("on_epoch_end", "save_checkpoint", folder, everywhere=True)],
                checkpoint_dir=folder + "/ckpt")  # fmt: skip


def test_collective_called_from_a_callback_on_every_rank_still_works(tmp_path, run_on_ranks):
    results = run_on_ranks(_everywhere, str(tmp_path), world_size=2)
    assert [r["error"] for r in results] == [None, None]
    assert (tmp_path / "from-callback.pt").is_file()


class _StopsOnRankZero(distkit.Callback):
    def on_train_step_end(self, trainer, logs):
        pass


def _stops_differ() -> dict:
    callback = _StopsOnRankZero()
    callback.stops_training = os.environ["RANK"] == "0"  # type: ignore[misc]
    return _fit([callback])


def test_callbacks_whose_stops_training_differs_between_ranks_are_refused(run_on_ranks):
    results = run_on_ranks(_stops_differ, world_size=2)
    for result in results:
        assert result["type"] == "RankDisagreementError", result
        said = "callbacks: rank 0: _StopsOnRankZero; stop check after each step"
        assert said in result["error"], result["error"]
        assert result["seconds"] < TIMEOUT / 2


def test_tagged_sum_is_one_rank_a_plain_sum():
    from distkit.runtime._call_tags import tagged_sum

    trainer = distkit.Trainer("dp", progress=False)
    assert tagged_sum(trainer.strategy, "stop", [1.0, 2.0]) == [1.0, 2.0]


def test_call_tags_one_rank_sums_nothing_and_gets_its_own_numbers(monkeypatch):
    """In a world of one no rank can be in another call: the tagged sum hands the numbers
    back without a collective (and without a host read)."""
    from distkit.runtime import tagged_sum

    runtime = distkit.Runtime(strategy="dp")
    try:
        strategy = runtime.strategy

        def no_sum(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a world of one summed")

        monkeypatch.setattr(type(strategy), "all_reduce_async", no_sum)
        assert tagged_sum(strategy, "log", [1.5, 2, 0]) == [1.5, 2.0, 0.0]
        with pytest.raises(ValueError, match="at most"):
            tagged_sum(strategy, "log", [0.0] * 7)
    finally:
        runtime.close()
