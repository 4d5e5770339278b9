"""Where a fit stands: everything a resume needs besides the model and the optimizer.

The training loop advances it; checkpoints, the elastic snapshot and the resume read and
restore it. It lives here, below the loop, so that they need not import the loop.
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
    samples: int = 0  # this rank's real samples so far in the epoch
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
