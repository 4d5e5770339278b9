"""``nonfinite="raise"`` without a host synchronisation per step.

Reading a loss on the host (``bool(torch.isfinite(loss))``) makes the CPU wait for the GPU
every step, which empties its queue of kernels. Instead every optimizer step's loss sum,
a device tensor the loop keeps anyway, is noted here, and :meth:`NonFiniteWatch.check` reads
them all at once at the trainer's check points (every ``log_every_n_steps`` steps, before a
validation or a checkpoint, at the end of each epoch and of ``fit``). One small all-reduce
there tells every rank which rank saw the first non-finite loss, at which step, so that
every rank raises the same error together (none is left waiting in a collective).

The price is a delay: the steps between the bad one and the next check point train on (the
error says how many); no checkpoint is written after a bad step, and the history never
records one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from distkit.errors import NonFiniteLossError
from distkit.strategies.base import Strategy

#: how a non-finite value travels in the all-reduce (0: all finite)
_KINDS = {1.0: "nan", 2.0: "inf", 3.0: "-inf"}


@dataclass
class NonFiniteWatch:
    """The loss sums of one rank's steps since the last check (``enabled``: policy raise)."""

    enabled: bool
    every: int  # log_every_n_steps, for the error's explanation
    _noted: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)

    def note(self, epoch: int, step: int, loss_sum: torch.Tensor) -> None:
        """Keep ``loss_sum`` (this rank's step ``step``, a float64 scalar; not read here)."""
        if self.enabled:
            self._noted.append((epoch, step, loss_sum))

    def check(self, strategy: Strategy, now: int) -> None:
        """Raise :class:`NonFiniteLossError` on every rank if any rank noted a non-finite loss.

        A collective (call it on every rank at the same point): one host read of this rank's
        noted sums and one all-reduce of ``2 x world_size`` numbers. ``now`` is the current
        global step, for the message.
        """
        if not self.enabled:
            return
        noted, self._noted = self._noted, []
        size, rank = strategy.world_size, strategy.rank
        slots = torch.zeros(2 * size, dtype=torch.float64, device=strategy.device)
        if noted:
            sums = torch.stack([loss for _, _, loss in noted])  # float64 scalars
            values = sums.tolist()  # the host read
            first = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
            if first is not None:
                value = values[first]
                slots[rank] = noted[first][1] + 1
                slots[size + rank] = 1.0 if math.isnan(value) else 2.0 if value > 0 else 3.0
        if size > 1:
            slots = strategy.all_reduce(slots, op="sum")
        found = slots.tolist()
        steps = [int(s) - 1 for s in found[:size]]
        if max(steps) < 0:
            return
        step = min(s for s in steps if s >= 0)
        ranks = [r for r, s in enumerate(steps) if s == step]
        epochs = {s: e for e, s, _ in noted}
        raise NonFiniteLossError(
            _message(_KINDS[found[size + ranks[0]]], ranks, epochs.get(step), step, now, self.every)
        )


def _message(
    value: str, ranks: list[int], epoch: int | None, step: int, now: int, every: int
) -> str:
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    when = f"step {step}" if epoch is None else f"epoch {epoch}, step {step}"
    later = now - step - 1
    delay = (
        ""
        if later <= 0
        else (
            f" (found {later} step(s) later: distkit reads the losses every "
            f"log_every_n_steps={every} steps, before validations and checkpoints and at the "
            "end of each epoch, not after every step, so as not to stall the GPU; the steps "
            "in between trained on it)"
        )
    )
    return (
        f"non-finite training loss ({value}) on {where} in {when}{delay}. Lower the learning "
        "rate, check the data, or pass nonfinite='skip' to skip such steps on every rank."
    )
