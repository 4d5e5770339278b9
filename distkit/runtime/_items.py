"""Token-exact (item-exact) losses: one optimizer's item counts over its window.

A loss given as ``Loss(total, count)`` (or ``rt.backward(total, count=n)``) is
backpropagated as ``total * scale``, where ``scale = world_size / step_samples`` is the same
on every rank and for every micro-batch of the window (it keeps the gradients' magnitude that
of a per-sample mean, which matters to fp16's loss scale); the counts are summed per
optimizer. The backend averages the gradients over ranks, so at the step they are ``scale /
world_size`` times the sum of every item's gradient over every rank and micro-batch, and one
multiplication by ``world_size / (scale * C)``, with ``C`` the step's global count, makes
them the gradient of the mean over the step's items: what one process computes with the
whole global batch, whatever the padding. (``world_size`` here is the data-parallel ranks:
under tensor parallelism a group's ranks hold the same items, and only its first counts them.)
It runs on the finalized (averaged, unscaled)
gradients, before the callbacks' ``on_before_optimizer_step`` and clipping (so clipping sees
the normalised gradients).

``C`` takes no device synchronisation. At an optimizer's first step the ranks agree, in one
host-side sum, on the kind of loss (token-exact on every rank, or on none: else all fail at
once) and of count. Counts given as Python ints are then summed on the host (one host-side
sum per step, as a stop check is), counts given as tensors on the device (one all-reduce of
a scalar per step, nothing read). With host counts a step over zero items on every rank is
refused at once; with device counts it is found at the next check point (it applied zero
gradients). A mean loss's steps sum nothing after the first.
"""

from __future__ import annotations

import torch

from distkit.errors import ConfigurationError
from distkit.runtime._call_tags import tagged_sum
from distkit.strategies.base import Strategy


def zero_items(steps: str) -> str:
    """The refusal of ``steps`` ("an optimizer step", "2 optimizer steps") over no items."""
    return (
        f"{steps} had a count of 0 items on every rank (every Loss / rt.backward count= of "
        "its accumulation window was 0): its mean loss is undefined and no gradient can be "
        "normalised by it. Leave such batches out of the data (e.g. sequences that are all "
        "padding, or whose labels are all -100), or give them at least one item"
    )


class ItemWindow:
    """The items one optimizer's gradients sum since its last step, and how they were
    scaled (see the module's docstring)."""

    def __init__(self) -> None:
        self.mode: str | None = None  # "items" (Loss / count=), "mean" (a plain loss), None
        self.scale = 1.0  # what each total was multiplied by before backward
        self.host = 0  # counts given as ints, summed
        self.device: torch.Tensor | None = None  # counts given as tensors, summed (float64)
        #: steps whose global count was 0, found on the device (read at check points)
        self.empty_steps: torch.Tensor | None = None
        #: this rank's lowest tensor count since the last check (float64, on the device): a
        #: negative one (a sign slip) is found at the next check point, as a zero count is
        self.lowest: torch.Tensor | None = None
        #: steps where some rank gave a negative tensor count (read at check points)
        self.negative_steps: torch.Tensor | None = None
        self._window_lowest: torch.Tensor | None = None  # this window's lowest count
        #: how the counts are summed over ranks: None until the optimizer's first step,
        #: then "host", "device" or "both" (see _first_sums)
        self.sums: str | None = None
        self._first: list[float] | None = None  # the first step's host-side sum

    def note_mean(self, where: str) -> None:
        """A plain (mean) loss's gradients go into this window."""
        if self.mode == "items":
            raise ConfigurationError(_mixed(where))
        self.mode = "mean"

    def note_items(self, count: int | torch.Tensor, scale: float, where: str) -> None:
        """``count`` items, backpropagated as their total times ``scale``."""
        if self.mode == "mean":
            raise ConfigurationError(_mixed(where))
        if self.mode == "items" and scale != self.scale:
            raise ConfigurationError(
                f"{where}: the losses of one accumulation window were scaled differently "
                f"({self.scale} and {scale}): call optimizer.step() at the end of each "
                "window of rt.loader's batches (or of each batch outside rt.loader)"
            )
        self.mode, self.scale = "items", scale
        if isinstance(count, torch.Tensor):
            value = count.detach().sum().to(torch.float64)
            self.device = value if self.device is None else self.device + value
            low = self._window_lowest
            self._window_lowest = value if low is None else torch.minimum(low, value)
        else:
            self.host += int(count)

    def reset(self) -> None:
        """A new window (after a step, or gradients cleared)."""
        self.mode, self.scale, self.host, self.device = None, 1.0, 0, None
        self._window_lowest = None

    def factor(self, strategy: Strategy) -> float | torch.Tensor | None:
        """What the step's averaged gradients are multiplied by (None: a plain loss's
        window, nothing to do). A collective at an optimizer's first step (the ranks agree
        on the kind of loss and of count) and at every step of a window of items: every
        rank calls it at the same step."""
        items = self.mode == "items"
        if self.sums is None:  # the first step: its host-side sum is this step's too
            self.sums = self._first_sums(strategy, items)
            return self._from_sums(strategy, items)
        if not items:
            return None  # a mean loss's step: nothing to sum (after the first)
        if self.sums == "device":  # every rank's counts on the device: one device all-reduce
            local = self.device if self.device is not None else _zero(strategy.device)
            local = local + self.host if self.host else local
            return self._device_factor(strategy, *self._device_sum(strategy, local), 0.0)
        if self.sums == "host" and self.device is not None:
            raise ConfigurationError(
                "a token-exact count was given as a tensor, where the ranks agreed at this "
                "optimizer's first step that every count is an int: give counts of one kind "
                "throughout (a tensor count may stay on the device: (labels != -100).sum())"
            )
        return self._from_sums(strategy, items)

    def _host_share(self, strategy: Strategy) -> float:
        """This rank's host count in a sum over the world: its own, but nothing on the
        ranks of a tensor-parallel group after its first (they hold the same items)."""
        return float(self.host) if strategy.data_leader else 0.0

    def _first_sums(self, strategy: Strategy, items: bool) -> str:
        """How the counts are summed from now on: "host" (every rank gave ints: one
        host-side sum a step), "device" (tensors: one device all-reduce a step), or "both"
        (a sum of each, every step: an elastic strategy, where a process that joins mid-fit
        starts with a fresh optimizer and could not meet an agreement only it makes).
        Elsewhere the ranks agree at the optimizer's first step, in a host-side sum that
        also holds that step's counts (kept in ``self._first``)."""
        if strategy.elastic is not None:
            return "both"
        values = [self._host_share(strategy), float(self.device is not None), float(items)]
        self._first = tagged_sum(strategy, "items", values)
        _, devices, token_ranks = self._first
        if 0 < token_ranks < strategy.world_size:
            raise ConfigurationError(
                f"the ranks disagree on the kind of loss at this optimizer's first step: "
                f"{int(token_ranks)} of {strategy.world_size} gave token-exact losses "
                "(distkit.Loss / rt.backward(total, count=n)) and the others mean losses. "
                "Every rank must run the same step function: return the same kind on every "
                "rank (a rank with no tokens returns distkit.Loss(total, 0))"
            )
        return "device" if devices else "host"

    def _from_sums(self, strategy: Strategy, items: bool) -> float | torch.Tensor | None:
        """This step's factor from a host-side sum of the counts (the first step's, taken
        already; else one now), plus a device all-reduce where any rank's counts were
        tensors."""
        first, self._first = self._first, None
        if not items:
            return None
        if first is None:
            values = [self._host_share(strategy), float(self.device is not None), float(items)]
            first = tagged_sum(strategy, "items", values)
        host, devices, _ = first
        if not devices:  # every rank's counts were ints: the global count is known here
            if host == 0:
                raise ConfigurationError(zero_items("an optimizer step"))
            return strategy.data_world_size / self.scale / host
        local = self.device if self.device is not None else _zero(strategy.device)
        return self._device_factor(strategy, *self._device_sum(strategy, local), host)

    def _device_sum(
        self, strategy: Strategy, local: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's global count and how many ranks gave a negative tensor count in it,
        in one all-reduce of two numbers (nothing read on the host). This rank's lowest
        count is kept for the check point's message."""
        low = self._window_lowest
        negative = _zero(local.device) if low is None else (low < 0).to(torch.float64)
        if low is not None:
            self.lowest = low if self.lowest is None else torch.minimum(self.lowest, low)
        if not strategy.data_leader:  # its tensor-parallel group's first counts its items
            local = torch.zeros_like(local)
        pair = torch.stack([local.reshape(()), negative.to(local.device)])
        summed = strategy.all_reduce(pair.to(strategy.device), op="sum")
        return summed[0], summed[1]

    def _device_factor(
        self, strategy: Strategy, total: torch.Tensor, negative: torch.Tensor, host: float
    ) -> torch.Tensor:
        """The factor from a device count (plus ``host`` items summed on the host): 0 where
        the count is 0 or some rank's count was negative, noted for the next check point."""
        total = total + host if host else total
        if host == 0:  # only the device knows whether any rank had an item
            empty = (total == 0).to(torch.int64)
            self.empty_steps = empty if self.empty_steps is None else self.empty_steps + empty
        bad = (negative > 0).to(torch.int64)
        self.negative_steps = bad if self.negative_steps is None else self.negative_steps + bad
        numerator = strategy.data_world_size / self.scale
        usable = (total > 0) & (negative == 0)
        return torch.where(usable, numerator / total.clamp(min=1), torch.zeros_like(total))

    def check(self) -> None:
        """Raise if a step since the last check had zero items on every rank (one host
        read, of device counts only; every rank holds the same value, so all raise)."""
        negative, self.negative_steps = self.negative_steps, None
        lowest, self.lowest = self.lowest, None
        if negative is not None and int(negative):
            slips = int(negative)
            here = (
                f"this rank's lowest was {_count_text(lowest)}"
                if lowest is not None and float(lowest) < 0
                else "this rank's were not negative: another rank's were"
            )
            raise ConfigurationError(
                f"Loss.count (rt.backward count=) must be >= 0 (a number of items), but "
                f"{'an optimizer step' if slips == 1 else f'{slips} optimizer steps'} had a "
                f"negative tensor count on some rank ({here}). A sign slip such as "
                "-(labels != -100).sum() trains nothing: give the count of items, "
                "(labels != -100).sum(). (Found at this check point: counts given as tensors "
                "are read only at check points; such a step applied zero gradients.)"
            )
        empty, self.empty_steps = self.empty_steps, None
        found = 0 if empty is None else int(empty)
        if found:
            steps = "an optimizer step" if found == 1 else f"{found} optimizer steps"
            raise ConfigurationError(
                f"{zero_items(steps)}. (Found at this check point: counts given as tensors "
                "are read only at check points; such a step applied zero gradients.)"
            )


def _count_text(count: torch.Tensor) -> str:
    value = float(count)
    return str(int(value)) if value.is_integer() else str(value)


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64, device=device)


def _mixed(where: str) -> str:
    return (
        f"{where}: one accumulation window mixes token-exact losses (distkit.Loss(total, "
        "count) / rt.backward(total, count=n)) with plain mean losses for the same "
        "optimizer: its gradients cannot be normalised by one count. Give every loss of "
        "the window as a sum and a count, or none"
    )
