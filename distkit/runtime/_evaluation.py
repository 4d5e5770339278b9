"""Evaluation over a rank's shard, reduced so that every sample counts exactly once."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from distkit._validate import check_instance
from distkit.batch import batch_size_of, split_batch, to_device
from distkit.errors import ConfigurationError
from distkit.metrics import Metric
from distkit.strategies._placement import Placement, follow_output
from distkit.strategies.base import Strategy

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
Metrics = Mapping[str, Metric] | Sequence[Metric]


def named_metrics(metrics: Metrics | None) -> dict[str, Metric]:
    """``{name: metric}`` from a mapping or a list (named after the class), validated."""
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        items = list(metrics.items())
    else:
        items = [(type(m).__name__.lower(), m) for m in metrics]
    for name, metric in items:
        check_instance(
            metric,
            Metric,
            where=f"metric {name!r}",
            name="distkit.metrics.Metric",
            args="()",
            fix="use distkit.metrics.Accuracy(), MeanIoU(num_classes), or subclass Metric",
        )
    return dict(items)


def evaluate_shard(
    strategy: Strategy,
    module: nn.Module,
    batches: Iterable[tuple[Any, bool]],
    loss_fn: LossFn | None,
    metrics: dict[str, Metric],
    placement: Placement,
) -> dict[str, float]:
    """Loss and metrics over this rank's shard, summed over ranks (one all-reduce).

    ``batches``: this rank's batches, each with whether it counts (see :func:`map_rounds`
    and :func:`stream_rounds`: a rank whose shard ran out may run spare forward passes that
    count for nothing, where a forward pass communicates). ``placement``: the batches go to
    its input device, and where the user placed the model on devices of their own, targets
    go to the output's device.
    """
    for metric in metrics.values():
        metric.reset()
    device = strategy.device
    inputs_to, placed = placement.input_device, placement.user_placed
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    count = torch.zeros(1, dtype=torch.float64, device=device)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for batch, counted in batches:
                inputs, target = split_batch(to_device(batch, inputs_to))
                with strategy.autocast():
                    output = module(inputs)
                    if not counted:
                        continue
                    if placed:
                        target = follow_output(target, output)
                    loss = loss_fn(output, target) if loss_fn is not None else None
                size = batch_size_of(target)
                if loss is not None:
                    loss_sum += strategy.reduce_loss(loss, size).to(device).double() * size
                count += size
                for metric in metrics.values():
                    metric.update(output, target)
    finally:
        module.train(was_training)
    states = [metric.state(device) for metric in metrics.values()]
    packed = strategy.all_reduce(
        torch.cat([loss_sum, count, *(s.reshape(-1) for s in states)]), op="sum"
    )
    scores: dict[str, float] = {}
    if loss_fn is not None:
        scores["loss"] = (packed[0] / packed[1]).item() if packed[1] else float("nan")
    offset = 2
    for (name, metric), state in zip(metrics.items(), states, strict=True):
        total = packed[offset : offset + state.numel()].reshape(state.shape)
        offset += state.numel()
        value = metric.compute(total)
        if isinstance(value, dict):
            scores.update({(k if k == name else f"{name}_{k}"): v for k, v in value.items()})
        else:
            scores[name] = value
    return scores


def as_score(name: str, value: object) -> float:
    """A metric's value as a plain float (numpy scalars, ints and 1-element tensors too)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real):  # numpy's number types register as Real
        return float(value)
    raise ConfigurationError(
        f"metric {name!r} returned a {type(value).__name__} ({value!r:.60}); Metric.compute "
        "must return a number or a dict of numbers"
    )
