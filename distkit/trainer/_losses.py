"""This rank's training losses: kept per step without device work, summed in batches.

Adding a loss to a device total every step costs a few tensor operations (several
microseconds of Python and kernel launches per step, for a number nobody reads until the
next log point). Instead each optimizer step hands its micro-batches' detached losses and
sample counts to :class:`LossLedger` (list appends), and :meth:`LossLedger.fold` sums
everything since the previous fold in a handful of tensor operations: into the epoch's
total (``FitState.loss_sum``), into the log window's total, and into the non-finite flags
that ``nonfinite="raise"`` reads. The trainer folds at its check points (log points,
validations, checkpoints, the end of an epoch or of ``fit``) and every ``FOLD_EVERY``
losses, which bounds what is kept. Nothing here reads a device value on the host except
:meth:`LossLedger.first_nonfinite` and :meth:`LossLedger.read_window`.
"""

from __future__ import annotations

import math

import torch

#: fold after this many noted losses even between check points (bounds the lists)
FOLD_EVERY = 512

Where = tuple[int, int]  # (epoch, global step) of a noted loss
Found = tuple[int, int, str]  # (epoch, step, "nan" | "inf" | "-inf") of the first bad loss


class LossLedger:
    """One fit's noted losses on one rank.

    Attributes:
        epoch_sum: this rank's loss x samples over the epoch's folded steps (float64, on the
            training device; ``FitState.loss_sum`` during the epoch).
        window_sum: the same since the last log point (the window may span epochs).
        watch: keep the folded losses for :meth:`first_nonfinite` (``nonfinite="raise"``).
    """

    def __init__(self, device: torch.device, *, watch: bool) -> None:
        self.watch = watch
        self.epoch_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.window_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._losses: list[torch.Tensor] = []
        self._counts: list[int | torch.Tensor] = []
        self._where: list[Where] = []
        #: folded losses and where each was noted, kept for first_nonfinite (watch only)
        self._folded: list[tuple[torch.Tensor, list[Where]]] = []

    def begin_epoch(self, loss_sum: float) -> torch.Tensor:
        """Start an epoch's total at ``loss_sum`` (a resumed epoch's); returns it."""
        self.fold()  # what is noted belongs to the window and to the previous epoch's total
        self.epoch_sum = torch.tensor(loss_sum, dtype=torch.float64, device=self.epoch_sum.device)
        return self.epoch_sum

    def add_step(
        self, losses: list[torch.Tensor], counts: list[int | torch.Tensor], epoch: int, step: int
    ) -> None:
        """Note one optimizer step's counted micro-batches: detached batch-mean losses and
        what each is a mean over (its real samples, or a token-exact loss's items)."""
        self._losses += losses
        self._counts += counts
        if self.watch:
            self._where += [(epoch, step)] * len(losses)
        if len(self._losses) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Sum the noted losses into ``epoch_sum`` and ``window_sum`` (no host read)."""
        if not self._losses:
            return
        values, total = _weighted_sum(self._losses, self._counts, self.epoch_sum.device)
        self.epoch_sum += total
        self.window_sum += total
        if self.watch:
            self._folded.append((values, self._where))
        self._losses, self._counts, self._where = [], [], []

    def first_nonfinite(self) -> Found | None:
        """``(epoch, step, "nan" | "inf" | "-inf")`` of the first non-finite loss noted since
        the last call (None: all finite): folds, then one host read of the losses."""
        self.fold()
        folded, self._folded = self._folded, []
        if not folded:
            return None
        return _first_bad(torch.cat([v for v, _ in folded]).tolist(), folded)

    def read_window(self, samples: int | torch.Tensor) -> tuple[float, float, Found | None]:
        """A log point's numbers in one host read: the window's total (then a new window
        from zero), ``samples`` (the window's count, a number or a device tensor) as a number,
        and :meth:`first_nonfinite`'s answer."""
        self.fold()
        total, self.window_sum = self.window_sum, torch.zeros_like(self.window_sum)
        folded, self._folded = self._folded, []
        count = torch.as_tensor(samples, dtype=torch.float64, device=total.device).view(1)
        values = torch.cat([total.view(1), count, *[v for v, _ in folded]]).tolist()
        return values[0], values[1], _first_bad(values[2:], folded) if folded else None


def _first_bad(values: list[float], folded: list[tuple[torch.Tensor, list[Where]]]) -> Found | None:
    """The first non-finite of ``values`` (the folded losses, read) and where it was noted."""
    first = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if first is None:
        return None
    epoch, step = [w for _, ws in folded for w in ws][first]
    value = values[first]
    return epoch, step, "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def step_mean(
    losses: list[torch.Tensor], counts: list[int | torch.Tensor], samples: int | torch.Tensor
) -> torch.Tensor:
    """One step's mean loss over its real samples (or items; a device tensor, for the step
    logs)."""
    return _weighted_sum(losses, counts, losses[0].device)[1] / samples


def _weighted_sum(
    losses: list[torch.Tensor], counts: list[int | torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The losses as one float64 vector on ``device``, and their sum weighted by ``counts``
    (loss x samples, or a token-exact loss's mean x items): a few tensor operations, no host
    read."""
    values = _stacked(losses, device)
    if all(isinstance(count, int) for count in counts):
        weights = torch.tensor(counts, dtype=torch.float64).to(device, non_blocking=True)
    else:  # token-exact counts given as tensors: they stay on the device
        weights = torch.stack([torch.as_tensor(c).to(device, torch.float64) for c in counts])
    return values, torch.dot(values, weights)


def _stacked(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The losses as one float64 vector on ``device`` (two tensor operations when they
    share a dtype and device, as a loss function's outputs do)."""
    first = losses[0]
    if all(loss.dtype == first.dtype and loss.device == device for loss in losses):
        return torch.stack(losses).double()
    return torch.stack([loss.to(device, torch.float64) for loss in losses])
