"""Counting host synchronisations per optimizer step during a real ``fit``.

On a GPU, reading a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``,
``.cpu()``, ``float(t)``, ``.numpy()``) waits for every kernel queued before it: one per step
stalls the pipeline. There is no GPU here, so the count is taken on CPU by wrapping those
``torch.Tensor`` methods for the duration of a fit and filing each call under the optimizer
step in progress (a callback's ``on_train_step_end`` closes a step). Run by the tests on
every backend (in-process for dp, on real gloo / horovodrun processes for the others).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

import distkit
from tests.support.workloads import make_dataset, make_mlp

#: the Tensor methods that read a value on the host
READS = ("item", "__bool__", "tolist", "cpu", "__float__", "__int__", "numpy")


class StepSpans(distkit.Callback):
    stops_training = False  # it only watches (a callback that may stop adds a host sum)

    """Host reads filed by step: ``spans[k]`` holds those after step k's end (k=0: set-up)."""

    def __init__(self) -> None:
        self.spans: list[list[str]] = [[]]

    def on_train_step_end(self, trainer: Any, logs: Any) -> None:
        self.spans.append([])

    def record(self, what: str) -> None:
        self.spans[-1].append(what)


@contextlib.contextmanager
def counting(spans: StepSpans) -> Iterator[None]:
    """Wrap the reads; each call files ``"<method> at <file>:<line>"`` of its caller."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, real: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            spans.record(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return real(self, *args, **kwargs)

        return read

    try:
        for name, real in originals.items():
            setattr(torch.Tensor, name, wrap(name, real))
        yield
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)


def _token_step(model: torch.nn.Module, batch: Any) -> distkit.Loss:
    """A token-exact loss whose count stays a device tensor (each sample one item)."""
    x, y = batch
    total = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    return distkit.Loss(total, (y >= 0).sum())


def syncs_per_step(
    strategy: Any, *, token_exact: bool = False, samples_per_rank: int = 64, **settings: Any
) -> list[list[str]]:
    """Fit a small MLP with ``strategy`` and return the host reads filed by step.

    ``settings`` go to the Trainer (batch_size 4, one epoch of ``samples_per_rank`` samples
    per rank unless given).
    Element 0 is set-up before the first step; element k (k >= 1) is what happened after
    step k ended until step k+1 ended (a log point's reads after step k land there).
    """
    options: dict[str, Any] = {"batch_size": 4, "max_epochs": 1, "progress": False}
    options.update(settings)
    spans = StepSpans()
    trainer = distkit.Trainer(strategy, callbacks=[spans], **options)
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = make_dataset(samples_per_rank * trainer.world_size)
    with counting(spans):
        if token_exact:
            trainer.fit(model, optimizer, data, step_fn=_token_step)
        else:
            trainer.fit(model, optimizer, data, loss_fn=torch.nn.functional.cross_entropy)
    return spans.spans


def steady_syncs(spans: list[list[str]], log_every: int) -> dict[int, list[str]]:
    """The reads of steps that are neither a log point's follower nor the epoch's edges.

    ``spans`` is :func:`syncs_per_step`'s result for one epoch. Span 0 (set-up and the
    first step) and the last span (the epoch's end) are left out, as is span k for each
    log point k (its gather happens after step k ends).
    """
    last = len(spans) - 1
    return {k: spans[k] for k in range(1, last) if k % log_every != 0 and spans[k]}


def may_stop_sums() -> tuple[list[str], list[list[str]]]:
    """A 16-step dp/ddp fit (by world size) with a callback that may stop after any step: the
    device of every tensor the strategy's host-side sums got, and the host reads by step."""
    sums: list[str] = []

    def spy(self: distkit.Strategy, tensor: torch.Tensor, *, name: str) -> Any:
        sums.append(tensor.device.type)
        return real(self, tensor, name=name)

    class MayStop(StepSpans):
        stops_training = True

    spans = MayStop()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = distkit.Trainer("ddp" if world > 1 else "dp", batch_size=4, max_epochs=1,
                              progress=False, callbacks=[spans])  # fmt: skip
    model = torch.nn.Linear(6, 3)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64 * world, 6, generator=generator),
        torch.randint(0, 3, (64 * world,), generator=generator),
    )
    backend = type(trainer.strategy)  # its own sum (torch.distributed's: on a gloo group)
    real = backend.all_reduce_async
    backend.all_reduce_async = spy  # type: ignore[method-assign]
    try:
        with counting(spans):
            trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                        loss_fn=torch.nn.functional.cross_entropy)  # fmt: skip
    finally:
        backend.all_reduce_async = real  # type: ignore[method-assign]
    return sums, spans.spans
