"""A fit's whole state in host memory: what an elastic backend saves at each commit, restores
after a failed step, and sends from rank 0 to the processes of a changed group.

Unlike a checkpoint it never touches the disk, and it holds objects in place: the model's
parameters are copied into, the optimizer's state dict object is kept (a backend's wrapper
may share it), the :class:`~distkit.trainer._fit_state.FitState` is updated field by field.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from distkit.strategies.base import Strategy
from distkit.trainer._fit_state import FitState, Stateful


class RunSnapshot:
    """Model, optimizer, scheduler, progress and callback states of one fit."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: FitState,
        callbacks: Stateful,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.state, self.callbacks = state, callbacks
        # nothing is copied until an elastic backend asks (its first sync): a fit that is
        # not elastic never pays for a copy of the model
        self._saved: dict[str, Any] | None = None

    def capture(self) -> dict[str, Any]:
        """Copies of everything, as they are now."""
        state = self.state
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "fit": state.shared_state(),
            "local": state.rank_state(),
            "callbacks": self.callbacks.state_dict(),
        }

    def save(self) -> None:
        """Keep the current state (an elastic commit)."""
        self._saved = self.capture()

    def restore(self) -> None:
        """Go back to the last saved state (after a step failed half-way)."""
        if self._saved is not None:
            self._apply(self._saved, local=True)

    def sync(self, strategy: Strategy) -> None:
        """Take rank 0's saved state on every rank (after the group changed), and save it.

        The epoch's running loss sums are per rank: rank 0 keeps its own, the others start
        from zero, so the epoch's ``train_loss`` counts the samples trained since the change
        on every rank but rank 0 (a logged figure only; the weights are exact).
        """
        # rank 0's current state is its saved one: a sync follows a commit, or a restore
        shared = strategy.broadcast(self.capture() if strategy.is_main else None, src=0)
        self._apply(shared, local=strategy.is_main)
        self._saved = self.capture()

    def _apply(self, saved: dict[str, Any], *, local: bool) -> None:
        device = next(iter(self.model.parameters()), torch.empty(0)).device
        self.model.load_state_dict({k: v.to(device) for k, v in saved["model"].items()})
        shared_state = self.optimizer.state  # a wrapper (Horovod's) may share this object
        self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        loaded = self.optimizer.state
        shared_state.clear()
        shared_state.update(loaded)
        self.optimizer.state = shared_state
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self.state.load_shared_state(saved["fit"])
        self.state.load_rank_state(saved["local"] if local else None)
        self.callbacks.load_state_dict(saved["callbacks"])
