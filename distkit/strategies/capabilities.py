"""What only some strategies do differently, as small objects a strategy hands out.

A backend that needs its own way of doing one of these replaces one object instead of
overriding a group of hooks that must change together:

- :class:`StateIO`: the model's and optimizer's full state, read and written in torch's
  own form (whole, or one tensor at a time for ``save_weights``), and the entries of a
  checkpoint file. Every strategy gets the default from
  :attr:`Strategy.state_io <distkit.strategies.base.Strategy.state_io>`; FSDP returns one
  that gathers and scatters shards (its reads are collectives).
- :class:`Elastic`: a fit whose processes may join or leave while it runs (Horovod elastic
  under ``horovodrun --min-np``). :attr:`Strategy.elastic
  <distkit.strategies.base.Strategy.elastic>` is None for every other backend.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from distkit.checkpoint import _pending_weights
from distkit.errors import ConfigurationError
from distkit.strategies import _meta_init


class _HasPlace(Protocol):
    @property
    def is_main(self) -> bool: ...


class StateIO:
    """The model's and optimizer's state in full, in torch's own form, as one backend holds
    them. Default: the module's and optimizer's own ``state_dict`` (the model is whole on
    every rank).

    Args:
        strategy: the strategy it serves (read for ``is_main``, and by a subclass for its
            collectives).
    """

    #: whether reading the model's full state is a collective (the model is sharded over the
    #: ranks): a read then starts with the ranks' agreement, so a rank that reads alone fails
    #: with a distkit error instead of gloo's raw one
    collective = False

    def __init__(self, strategy: _HasPlace) -> None:
        self.strategy = strategy

    def model_state_dict(
        self, model: nn.Module, *, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """The full (unsharded) state of the user's ``model`` as CPU tensors, its own keys.

        A collective where the strategy shards the model: call it on every rank. With
        ``rank0_only`` the other ranks may get ``{}`` (they need not hold a copy).
        """
        if rank0_only and not self.strategy.is_main:
            return {}
        return {
            key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
            for key, value in model.state_dict().items()
        }

    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        """The optimizer's full state in torch's own form (keyed by parameter order).

        A collective where the strategy shards it; ``rank0_only`` as in
        :meth:`model_state_dict`.
        """
        if rank0_only and not self.strategy.is_main:
            return {}
        return optimizer.state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a full state (as :meth:`model_state_dict` returns) into the user's ``model``,
        set up or not. Every rank holds ``state``; no collective."""
        self._given_values(model, "a checkpoint's model state")
        model.load_state_dict(state)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load a full optimizer state (torch's form) into the user's ``optimizer``."""
        optimizer.load_state_dict(state)

    def load_sharded(
        self, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Load a checkpoint whose model and optimizer tensors are in a shards folder
        (``checkpoint="sharded"``) into the user's ``model`` and ``optimizer``, set up or
        not. Default: read straight into their own tensors, whatever their layout (each rank
        its slices; no collective). A backend that keeps a copy of the state of its own (ZeRO's
        master weights) reads full tensors and loads them as :meth:`load_model_state_dict`
        does."""
        from distkit.checkpoint import _shard_files

        self._given_values(model, "a sharded checkpoint")
        _shard_files.load(payload, model, optimizer)

    def _given_values(self, model: nn.Module, what: str) -> None:
        """A model with tensors on the meta device has none to load into (torch's copy into
        one is a no-op, lost without a word): wholly on meta with weights ``load_weights``
        recorded, it is materialised from them on the CPU first (the set-up then moves it);
        else refused. (fsdp and DeepSpeed stage 3 keep the state aside until they have
        materialised the model.)"""
        if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return
        if _meta_init.on_meta(model) and _pending_weights.recorded(model):
            _meta_init.materialise(model, torch.device("cpu"), _pending_weights.take(model))
            return
        name = getattr(self.strategy, "name", type(self.strategy).__name__)
        raise ConfigurationError(
            f"{what} was to be loaded into a model on the meta device under strategy "
            f"{name!r}: meta tensors hold no values to load into, and this strategy does not "
            "keep the state until the set-up has materialised the model. Build the model on "
            "the CPU, or use strategy='fsdp' or DeepSpeedStrategy(stage=3), which load it "
            "into the slices they materialise"
        )

    def shapes(self, model: nn.Module) -> dict[str, torch.Size | None]:
        """The full shape of each entry of the user's ``model``'s state (None: not a
        tensor), set up or not; what a checkpoint's tensors must match."""
        return {
            key: value.shape if isinstance(value, torch.Tensor) else None
            for key, value in model.state_dict(keep_vars=True).items()
        }

    def param_groups(self, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        """The user's parameters in each group of ``optimizer``, set up or not (what a
        checkpoint's optimizer state must match, and what must belong to the model)."""
        return [list(group["params"]) for group in optimizer.param_groups]

    def weight_entries(self, model: nn.Module) -> dict[str, Any]:
        """The user's ``model``'s state as this backend holds it, for :meth:`full_tensor` to
        fetch one entry at a time (``save_weights``). Default: ``model.state_dict(keep_vars=
        True)``, whose values are the module's own parameters and buffers (tied ones are one
        object under two names). A sharded entry reports its global shape and dtype. Called
        on every rank, after the ranks agreed to save (a subclass may gather here)."""
        return model.state_dict(keep_vars=True)

    def full_tensor(self, entry: torch.Tensor, *, keep: bool) -> torch.Tensor | None:
        """One of :meth:`weight_entries`' values in full on the CPU, or None where ``keep``
        is False. A collective where the strategy shards the model (every rank, the same
        entries in the same order); default: a copy-free read of the local tensor."""
        return entry.detach().cpu() if keep else None

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path | str
    ) -> dict[str, Any]:
        """The ``model`` and ``optimizer`` entries of the checkpoint about to go to ``path``.

        Called on every rank; rank 0's result is written, the others may return ``{}``.
        Default: :meth:`model_state_dict` (reduced-precision floats as fp32) and
        :meth:`optimizer_state_dict`, on rank 0.
        """
        model_state = self.model_state_dict(model, rank0_only=True)
        optimizer_state = self.optimizer_state_dict(optimizer, rank0_only=True)
        if not self.strategy.is_main:
            return {}
        return {"model": fp32(model_state), "optimizer": optimizer_state}


@runtime_checkable
class Elastic(Protocol):
    """A fit whose processes may join or leave while it runs.

    With one, ``fit`` skips the collectives a joining process could not meet (the ranks'
    agreement, set-up broadcasts) and runs its epochs through :meth:`run`.
    """

    def run(self, body: Callable[[], None], snapshot: Any) -> None:
        """Run ``body`` (a fit's epochs); whenever the group changed, run it again after
        restoring the last committed ``snapshot`` (a
        :class:`distkit.trainer._snapshot.RunSnapshot`: ``save()``, ``restore()``,
        ``sync(strategy)``) and sending rank 0's to every rank (*collective*)."""
        ...

    def commit(self) -> None:
        """A point where the run is saved in memory and a changed group may be taken in
        (every ``checkpoint_every`` steps, or each epoch's end; *collective*)."""
        ...


def fp32(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its reduced-precision float tensors as fp32 (the checkpoint's form)."""
    half = (torch.float16, torch.bfloat16)
    return {
        key: value.float() if isinstance(value, torch.Tensor) and value.dtype in half else value
        for key, value in state.items()
    }
