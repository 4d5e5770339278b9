"""FSDPStrategy's StateIO: the full state of a sharded model and optimizer."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from distkit import checkpoint as ckpt
from distkit.checkpoint import _shard_files
from distkit.strategies.capabilities import StateIO
from distkit.strategies.fsdp import _meta
from distkit.strategies.fsdp import _pipeline_state as _pp_state
from distkit.strategies.fsdp import _state as _fsdp_state

#: the key under which a sharded checkpoint's payload waits for a meta model's set-up
SHARDED = "sharded checkpoint"

if TYPE_CHECKING:
    from distkit.strategies.fsdp import FSDPStrategy


class FSDPStateIO(StateIO):
    """The full state of a sharded model and optimizer: gathered to full tensors (every read
    is a collective), loaded by each rank into its shards; checkpoints either gathered into
    the file (``checkpoint="full"``) or written by every rank as shards beside it."""

    collective = True  # the full state is gathered from every rank's shard

    strategy: FSDPStrategy

    def __init__(self, strategy: FSDPStrategy) -> None:
        super().__init__(strategy)
        self._keys: dict[int, str] = {}  # under a pipeline: weight_entries' keys by entry

    @override
    def model_state_dict(
        self, model: nn.Module, *, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        pipeline = self._pipeline()
        if pipeline is not None:  # each stage's part, from the stage's first rank
            return _pp_state.full_model_state(model, pipeline, self.strategy, rank0_only=rank0_only)
        return _fsdp_state.full_model_state(model, keep=self.strategy.is_main or not rank0_only)

    @override
    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        pipeline = self._pipeline()
        if pipeline is not None:
            return _pp_state.full_optimizer_state(
                optimizer, pipeline, self.strategy, rank0_only=rank0_only
            )
        keep = self.strategy.is_main or not rank0_only
        return _fsdp_state.full_optimizer_state(optimizer, keep=keep)

    @override
    def weight_entries(self, model: nn.Module) -> dict[str, Any]:
        entries = model.state_dict(keep_vars=True)
        if self._pipeline() is not None:  # full_tensor sends each from the stage holding it
            self._keys = {id(value): key for key, value in reversed(entries.items())}
        return entries

    @override
    def full_tensor(self, entry: torch.Tensor, *, keep: bool) -> torch.Tensor | None:
        pipeline = self._pipeline()
        if pipeline is not None:
            key = self._keys[id(entry)]
            return _pp_state.full_entry(key, entry, pipeline, self.strategy, keep=keep)
        full = _fsdp_state.gathered(entry)  # an all-gather: every rank, in the same order
        return full if keep else None

    @override
    def param_groups(self, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        pipeline = self._pipeline()
        if pipeline is not None:  # as the user built it: every stage's parameters
            return [list(group) for group in pipeline.full_groups]
        return super().param_groups(optimizer)

    @override
    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        if _meta.on_meta(model):  # no values to load into yet: at the set-up
            self.strategy._before_setup[id(model)] = state
            return
        pipeline = self._pipeline()
        if pipeline is not None:
            _pp_state.load_full_model_state(model, state, pipeline)
            return
        _fsdp_state.load_full_model_state(model, state)

    @override
    def load_sharded(
        self, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        if _meta.on_meta(model):  # each rank reads its slices once they exist: at the set-up
            self.strategy._before_setup[id(model)] = {SHARDED: payload}
            return
        pipeline = self._pipeline()
        if pipeline is not None:
            _pp_state.load_sharded(payload, model, optimizer, pipeline)
            return
        super().load_sharded(payload, model, optimizer)

    @override
    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params and all(p.is_meta for p in params):  # a meta model's, not set up yet
            self.strategy._before_setup[id(optimizer)] = state
            return
        pipeline = self._pipeline()
        if pipeline is not None:
            _pp_state.load_full_optimizer_state(optimizer, state, pipeline)
            return
        _fsdp_state.load_full_optimizer_state(optimizer, state)

    def _pipeline(self) -> _pp_state.PipelineState | None:
        return self.strategy._pp_state

    @override
    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path | str
    ) -> dict[str, Any]:
        strategy = self.strategy
        if strategy.checkpoint == "full":
            return super().checkpoint_state(model, optimizer, path)
        # rank 0's path and a fresh name for this save, so that a checkpoint file being
        # replaced keeps its own shards until the new file is in place
        where, token = strategy.broadcast((str(path), secrets.token_hex(6)), src=0)
        folder = _shard_files.folder_for(ckpt.where(where), token)
        if strategy.is_main:
            _shard_files.sweep(folder.parent, keep=folder.name, named_by=ckpt.shards_named_by)
        pipeline = self._pipeline()
        if pipeline is not None:
            entries = _pp_state.save_sharded(folder, model, optimizer, pipeline, strategy)
        else:
            entries = _shard_files.save(
                folder, model, optimizer, strategy.all_gather_object, strategy.rank
            )
        return entries if strategy.is_main else {}
