"""Where a fit stands: everything a resume needs besides the model and the optimizer.

The training loop advances it; the Trainer's checkpoints, the elastic snapshot and the resume
read and restore it. It is the Trainer's alone (a user's own loop keeps its own counters); it
has a module of its own so that those need not import the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from distkit.trainer._losses import LossLedger


class Stateful(Protocol):
    """What a checkpoint or a snapshot carries besides tensors: the callbacks, for one (as
    ``torch.distributed.checkpoint.stateful.Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class FitState:
    """Where training stands; everything a resume needs besides model and optimizer."""

    epoch: int = 0  # the epoch in progress (or the next one)
    position: int = 0  # samples of this epoch already trained, over all ranks
    #: samples of this epoch this rank trained (None: unknown, resumed at another world size)
    local_position: int | None = 0
    global_step: int = 0  # optimizer steps taken (skipped ones included)
    #: this rank's loss x samples so far in the epoch: a float between epochs, the ledger's
    #: device total during one (current up to its last fold: read it with settled_loss_sum)
    loss_sum: float | torch.Tensor = 0.0
    #: this rank's real samples so far in the epoch (what loss_sum's mean is over), or with
    #: token-exact losses its items (a device tensor during an epoch where counts were)
    samples: int | float | torch.Tensor = 0
    skipped_steps: int = 0  # steps skipped this epoch (non-finite gradients or fp16 overflow)
    history: list[dict[str, float]] = field(default_factory=list)
    #: every validation so far (``{"step", "epoch", "val_...": ...}``), the resumed ones too
    validations: list[dict[str, float]] = field(default_factory=list)
    #: the epoch's loss ledger while one runs (not saved: loss_sum holds what it folded)
    ledger: LossLedger | None = field(default=None, repr=False, compare=False)

    def settled_loss_sum(self) -> float:
        """``loss_sum`` with every loss noted so far folded in (a host read on a GPU)."""
        if self.ledger is not None:
            self.ledger.fold()
        return float(self.loss_sum)

    # The one projection of the state that checkpoints and the elastic snapshot both use:
    # what every rank holds alike, and what is this rank's own.
    def shared_state(self) -> dict[str, Any]:
        """What every rank holds alike (copies)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "history": [dict(record) for record in self.history],
            "validations": [dict(record) for record in self.validations],
        }

    def rank_state(self) -> dict[str, Any]:
        """This rank's own part: its running loss sums and its place in a stream of its own."""
        return {
            "loss_sum": self.settled_loss_sum(),
            "samples": float(self.samples)
            if isinstance(self.samples, torch.Tensor)
            else self.samples,
            "local_position": self.local_position,
        }

    def load_shared_state(self, shared: dict[str, Any]) -> None:
        self.epoch = int(shared["epoch"])
        self.position = int(shared["position"])
        self.global_step = int(shared["global_step"])
        self.skipped_steps = int(shared.get("skipped_steps", 0))
        self.history = [dict(record) for record in shared.get("history", [])]
        self.validations = [dict(record) for record in shared.get("validations", [])]

    def load_rank_state(self, mine: dict[str, Any] | None) -> None:
        """This rank's part, or None where it is not known (another rank's, another world
        size): the running sums start from zero and the place in an own stream is unknown."""
        if mine is None:
            self.loss_sum, self.samples, self.local_position = 0.0, 0, None
            return
        self.loss_sum, self.samples = float(mine["loss_sum"]), mine["samples"]
        local = mine.get("local_position")
        self.local_position = None if local is None else int(local)
