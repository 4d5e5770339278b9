"""A loss given as a sum over items and how many items it sums: :class:`Loss`.

A language model's loss is a mean over tokens, and a batch's tokens are not its samples:
with padding, accumulation or several ranks, averaging per-batch means weights a token of a
short batch more than one of a long batch. Given the sum and the count instead, distkit
divides the step's summed gradients by the step's global count (every rank's, every
micro-batch's), so N processes train exactly like one, whatever the padding.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from distkit.errors import ConfigurationError


@dataclass(frozen=True)
class Loss:
    """A loss summed over ``count`` items (tokens, pixels, samples): return it from a
    ``step_fn`` (``distkit.Loss(total, count)``) for an item-exact (token-exact) loss.

    Args:
        total: the sum of the per-item losses of this micro-batch on this rank (a scalar
            tensor with a gradient), e.g. ``F.cross_entropy(logits, labels,
            ignore_index=-100, reduction="sum")``.
        count: how many items ``total`` sums (an int or an integer tensor, which may stay on
            the device: it is never read on the host per step), e.g. ``(labels !=
            -100).sum()``. Zero on one rank is fine (that rank contributes nothing); zero
            over a whole optimizer step on every rank is an error.
        output: what the model returned, for metrics at evaluation (``metric.update(output,
            batch)``); optional.
    """

    total: torch.Tensor
    count: int | torch.Tensor
    output: Any = None

    def __post_init__(self) -> None:
        check_total(self.total, "Loss.total")
        check_count(self.count, "Loss.count")

    @property
    def mean(self) -> torch.Tensor:
        """``total / count`` (0 where the count is 0): the micro-batch's mean per item."""
        return mean_of(self.total, self.count)


def check_total(total: object, what: str) -> None:
    """Refuse a total that is not a floating-point tensor (a scalar, or one value per
    DataParallel replica)."""
    if not isinstance(total, torch.Tensor):
        raise ConfigurationError(
            f"{what} must be a tensor (the sum of the per-item losses), got "
            f"{type(total).__name__}: e.g. F.cross_entropy(logits, labels, reduction='sum')"
        )
    if not total.is_floating_point():
        raise ConfigurationError(
            f"{what} must be a floating-point tensor, got dtype {total.dtype}: the sum of "
            "per-item losses (reduction='sum')"
        )
    if total.ndim > 1:
        raise ConfigurationError(
            f"{what} must be a scalar (the sum over the micro-batch's items), got shape "
            f"{tuple(total.shape)}: sum it (reduction='sum')"
        )


def check_count(count: object, what: str) -> None:
    """Refuse a count that is not a non-negative integer (a Python int or an integer
    tensor; a tensor's sign is not read on the host)."""
    if isinstance(count, bool):
        raise ConfigurationError(f"{what} must be an integer number of items, got a bool")
    if isinstance(count, torch.Tensor):
        if count.is_floating_point() or count.is_complex() or count.dtype == torch.bool:
            raise ConfigurationError(
                f"{what} must be an integer tensor (how many items the total sums), got "
                f"dtype {count.dtype}: e.g. (labels != -100).sum()"
            )
        if count.ndim > 1:
            raise ConfigurationError(
                f"{what} must be a scalar count, got shape {tuple(count.shape)}: sum it"
            )
        return
    if not isinstance(count, numbers.Integral):
        raise ConfigurationError(
            f"{what} must be an int or an integer tensor (how many items the total sums), "
            f"got {type(count).__name__} {count!r:.40}"
        )
    if count < 0:
        raise ConfigurationError(f"{what} must be >= 0 (a number of items), got {count}")


def mean_of(total: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """``total / count`` on the total's device, 0 where the count is 0 (no host read)."""
    total = total.sum() if total.ndim else total
    if isinstance(count, torch.Tensor):
        items = count.sum().to(total.device, torch.float64)
        return (total.double() / items.clamp(min=1)).to(total.dtype)
    return total / max(int(count), 1)
