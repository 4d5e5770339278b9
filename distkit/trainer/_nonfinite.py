"""``nonfinite="raise"`` without a host synchronisation per step.

Reading a loss on the host (``bool(torch.isfinite(loss))``) makes the CPU wait for the GPU
every step, which empties its queue of kernels. Instead the losses the loop keeps anyway
(:class:`~distkit.trainer._losses.LossLedger`) are read all at once by :meth:`NonFiniteWatch.check`
at the trainer's check points (every ``log_every_n_steps`` steps, before a validation or a
checkpoint, at the end of each epoch and of ``fit``). One small all-reduce
there tells every rank which rank saw the first non-finite loss, at which step, so that
every rank raises the same error together (none is left waiting in a collective).

The price is a delay: the steps between the bad one and the next check point train on (the
error says how many); no checkpoint is written after a bad step, and the history never
records one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distkit.errors import NonFiniteLossError
from distkit.runtime import tagged_sum
from distkit.strategies.base import Strategy
from distkit.trainer._losses import LossLedger

#: how a non-finite value travels in the all-reduce (0: all finite)
_KINDS = {1.0: "nan", 2.0: "inf", 3.0: "-inf"}
_CODES = {name: code for code, name in _KINDS.items()}


@dataclass(frozen=True)
class NonFiniteWatch:
    """``nonfinite="raise"``'s check over ranks (``enabled``: that policy is on)."""

    enabled: bool
    every: int  # log_every_n_steps, for the error's explanation

    def check(self, strategy: Strategy, ledger: LossLedger, now: int) -> None:
        """Raise :class:`NonFiniteLossError` on every rank if any rank noted a non-finite loss
        since the last check.

        A collective (call it on every rank at the same point): one host read of this rank's
        losses (:meth:`LossLedger.first_nonfinite`) and one all-reduce of ``3 x world_size``
        numbers. ``now`` is the current global step, for the message.
        """
        if not self.enabled:
            return
        found = ledger.first_nonfinite()
        size, rank = strategy.world_size, strategy.rank
        if size == 1:
            if found is not None:
                epoch, step, value = found
                raise NonFiniteLossError(_message(value, [rank], epoch, step, now, self.every))
            return
        # per rank: its first bad step + 1 (0: none), the value's code, its epoch
        mine = [0.0, 0.0, 0.0] if found is None else [found[1] + 1, _CODES[found[2]], found[0]]
        slots = torch.zeros(3, size, dtype=torch.float64)
        slots[:, rank] = torch.tensor(mine, dtype=torch.float64)
        summed = torch.tensor(tagged_sum(strategy, "nonfinite", slots.flatten().tolist()))
        steps_plus_one, codes, epochs = summed.view(3, size).tolist()
        steps = [int(s) - 1 for s in steps_plus_one]
        if max(steps) < 0:
            return
        step = min(s for s in steps if s >= 0)
        ranks = [r for r, s in enumerate(steps) if s == step]
        first = ranks[0]
        message = _message(_KINDS[codes[first]], ranks, int(epochs[first]), step, now, self.every)
        raise NonFiniteLossError(message)


def _message(value: str, ranks: list[int], epoch: int, step: int, now: int, every: int) -> str:
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    # ``step``: the optimizer steps done before the bad one; named 1-based, as the logs and
    # the checkpoint files count steps
    when = f"epoch {epoch}, step {step + 1}"
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
