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
from distkit.loss import Loss
from distkit.metrics import Metric
from distkit.runtime._step_result import model_loss
from distkit.strategies._placement import Placement, follow_output
from distkit.strategies.base import Strategy

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
#: ``step_fn(model, batch)`` -> a batch-mean loss, a ``distkit.Loss``, or the model's output
EvalStepFn = Callable[[nn.Module, Any], Any]
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
    step_fn: EvalStepFn | None = None,
) -> dict[str, float]:
    """Loss and metrics over this rank's shard, summed over ranks (one all-reduce).

    ``batches``: this rank's batches, each with whether it counts (see :func:`map_rounds`
    and :func:`stream_rounds`: a rank whose shard ran out may run spare forward passes that
    count for nothing, where a forward pass communicates). ``placement``: the batches go to
    its input device, and where the user placed the model on devices of their own, targets
    go to the output's device.

    ``step_fn(module, batch)`` instead of ``loss_fn`` (batches of any layout, a model that
    returns its own loss): a batch-mean loss counts once per sample, a ``distkit.Loss`` once
    per item (token-exact), and metrics get ``update(output, batch)`` with the output the
    step gave (``Loss(..., output=...)``, or the model's output it returned).
    """
    for metric in metrics.values():
        metric.reset()
    device = strategy.device
    inputs_to, placed = placement.input_device, placement.user_placed
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    count = torch.zeros(1, dtype=torch.float64, device=device)
    losses = torch.zeros(1, dtype=torch.float64, device=device)  # 1 where a loss was summed
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            if step_fn is not None:
                _step_fn_shard(strategy, module, batches, step_fn, metrics, inputs_to,
                               (loss_sum, count, losses))  # fmt: skip
            for batch, counted in () if step_fn is not None else batches:
                inputs, target = split_batch(to_device(batch, inputs_to))
                with strategy.autocast():
                    output = module(inputs)
                    if not counted:
                        continue
                    if placed:
                        target = follow_output(target, output)
                    loss = loss_fn(output, target) if loss_fn is not None else None
                size = batch_size_of(target)
                if isinstance(loss, Loss):  # token-exact: its total over its items
                    total = loss.total.sum() if loss.total.ndim else loss.total
                    loss_sum += total.detach().to(device, torch.float64)
                    count += torch.as_tensor(loss.count).sum().to(device, torch.float64)
                else:
                    if loss is not None:
                        loss_sum += strategy.reduce_loss(loss, size).to(device).double() * size
                    count += size
                for metric in metrics.values():
                    metric.update(output, target)
    finally:
        module.train(was_training)
    states = [metric.state(device) for metric in metrics.values()]
    mine = torch.cat([loss_sum, count, losses, *(s.reshape(-1) for s in states)])
    if not strategy.data_leader:  # a tensor-parallel group's samples count on its first rank
        mine = torch.zeros_like(mine)
    packed = strategy.all_reduce(mine, op="sum")
    scores: dict[str, float] = {}
    if loss_fn is not None or (step_fn is not None and packed[2] > 0):
        scores["loss"] = (packed[0] / packed[1]).item() if packed[1] else float("nan")
    offset = 3
    for (name, metric), state in zip(metrics.items(), states, strict=True):
        total = packed[offset : offset + state.numel()].reshape(state.shape)
        offset += state.numel()
        value = metric.compute(total)
        if isinstance(value, dict):
            scores.update({(k if k == name else f"{name}_{k}"): v for k, v in value.items()})
        else:
            scores[name] = value
    return scores


def _step_fn_shard(
    strategy: Strategy,
    module: nn.Module,
    batches: Iterable[tuple[Any, bool]],
    step_fn: EvalStepFn,
    metrics: dict[str, Metric],
    inputs_to: torch.device,
    sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """:func:`evaluate_shard`'s loop with a step function: its losses and counts summed
    into ``sums`` (loss sum, count, whether a loss was seen), its outputs to the metrics."""
    loss_sum, count, losses = sums
    device = loss_sum.device
    kinds: set[str] = set()
    for batch, counted in batches:
        batch = to_device(batch, inputs_to)
        with strategy.autocast():
            result = step_fn(module, batch)
        if not counted:
            continue
        loss = model_loss(result)
        output: Any = result
        if isinstance(loss, Loss):
            kinds.add("items")
            total = loss.total.sum() if loss.total.ndim else loss.total
            loss_sum += total.detach().to(device, torch.float64)
            count += torch.as_tensor(loss.count).sum().to(device, torch.float64)
            output = loss.output
        elif isinstance(loss, torch.Tensor):  # a batch-mean loss (dp: one per replica)
            kinds.add("mean")
            size = batch_size_of(batch)
            mean = strategy.reduce_loss(loss, size).detach().to(device, torch.float64)
            loss_sum += mean * size
            count += size
            output = None if loss is result else result
        else:
            loss = None  # the step gave an output only (for the metrics)
        if loss is not None:
            losses.fill_(1.0)
        if len(kinds) > 1:
            raise ConfigurationError(
                "the evaluation step function returned distkit.Loss(total, count) for some "
                "batches and a mean loss for others: one evaluation reports one mean, over "
                "items or over samples. Return the same kind for every batch"
            )
        if metrics and output is None:
            raise ConfigurationError(
                f"metrics ({', '.join(metrics)}) need the model's output, and the evaluation "
                "step function returned only a loss: return distkit.Loss(total, count, "
                "output=out), or the model's output itself (with .loss for the loss)"
            )
        for metric in metrics.values():
            metric.update(output, batch)


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
