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

from distkit.errors import NonFiniteLossError
from distkit.runtime import tagged_sum
from distkit.strategies.base import Strategy
from distkit.trainer._losses import Found, LossLedger

#: how a non-finite value travels in the all-reduce (0: all finite)
_KINDS = {1.0: "nan", 2.0: "inf", 3.0: "-inf"}
_CODES = {name: code for code, name in _KINDS.items()}


@dataclass
class NonFiniteWatch:
    """``nonfinite="raise"``'s check over ranks (``enabled``: that policy is on).

    A check is a host read of this rank's losses and one all-reduce of ``3 x world_size``
    numbers: :meth:`check` does both, or a log point carries :meth:`payload` in its own sum
    and hands the sum to :meth:`verdict`. A check at the global step of the previous one is
    skipped on every rank alike (losses are noted only with a step, and every rank is at the
    same step): the end of an epoch right after its last log point reads nothing.
    """

    enabled: bool
    every: int  # log_every_n_steps, for the error's explanation
    checked_at: int | None = None  # the global step of the latest check

    def due(self, now: int) -> bool:
        """Whether a check at global step ``now`` has anything to read (the same on every rank)."""
        return self.enabled and now != self.checked_at

    def check(self, strategy: Strategy, ledger: LossLedger, now: int) -> None:
        """Raise :class:`NonFiniteLossError` on every rank if any rank noted a non-finite loss
        since the last check.

        A collective (call it on every rank at the same point): one host read of this rank's
        losses (:meth:`LossLedger.first_nonfinite`) and one all-reduce of ``3 x world_size``
        numbers (none on one rank). ``now`` is the current global step, for the message.
        """
        if not self.due(now):
            return
        mine = self.payload(ledger.first_nonfinite(), strategy.world_size, strategy.rank)
        self.verdict(tagged_sum(strategy, "nonfinite", mine), now)

    def payload(self, found: Found | None, world_size: int, rank: int) -> list[float]:
        """This rank's part of the check's sum: per rank its first bad step + 1 (0: none),
        the value's code and its epoch (``3 x world_size`` numbers, zero but this rank's)."""
        slots = [0.0] * (3 * world_size)
        if found is not None:
            epoch, step, value = found
            slots[rank], slots[world_size + rank] = step + 1.0, _CODES[value]
            slots[2 * world_size + rank] = float(epoch)
        return slots

    def verdict(self, summed: list[float], now: int) -> None:
        """Raise on every rank when the summed payloads name a bad step (the first, and the
        ranks that saw it); ``now`` is the current global step."""
        self.checked_at = now
        size = len(summed) // 3
        steps = [int(s) - 1 for s in summed[:size]]
        if max(steps) < 0:
            return
        step = min(s for s in steps if s >= 0)
        ranks = [r for r, s in enumerate(steps) if s == step]
        first = ranks[0]
        value, epoch = _KINDS[summed[size + first]], int(summed[2 * size + first])
        raise NonFiniteLossError(_message(value, ranks, epoch, step, now, self.every))


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
