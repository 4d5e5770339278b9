"""The model's and optimizer's state under a pipeline, in the one layout every strategy reads.

Each rank holds its stages' parameters (the other stages' on the meta device, so that the
user's model keeps every name and shape) and an optimizer over them alone. A checkpoint, the
full state dict and ``save_weights`` use the one-process layout: the model's own keys, the
optimizer's state keyed by the position of each parameter in the optimizer as the user built
it (``global`` indices). Gathering the full state is a collective: each stage gathers its
slices (FSDP, tensor parallel) among its own ranks, then each stage's first rank sends its
part; loading needs none (every rank holds the full state and keeps its stages' part).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit.checkpoint import _shard_files
from distkit.strategies.fsdp import _state as _fsdp_state


@dataclass
class PipelineState:
    """Where the model's state lives: which stage holds each key, and the optimizer's map
    from this rank's parameters to their places in the user's optimizer."""

    owner: dict[str, int]  # state_dict key -> its stage
    mine: set[int]  # this rank's stages
    stage_root: bool  # this rank sends its stages' state (data and tensor coordinates 0)
    roots: list[int]  # each stage's first rank (the one that sends its state)
    #: the optimizer's parameters now (this rank's) -> their index in the user's optimizer
    global_index: list[int] = field(default_factory=list)
    #: each group's global indices, as the user built the optimizer
    global_groups: list[list[int]] = field(default_factory=list)
    #: each group's parameters, as the user built it: this rank's set-up ones and the others'
    #: meta stand-ins (what a checkpoint's optimizer state is checked against)
    full_groups: list[list[torch.Tensor]] = field(default_factory=list)

    def local(self, key: str) -> bool:
        """Whether this rank holds ``key`` (a buffer outside the state dict: every rank)."""
        return self.owner.get(key, next(iter(self.mine))) in self.mine


def drop_other_stages(model: nn.Module, state: PipelineState) -> None:
    """Every parameter and buffer of the other stages replaced by a meta tensor of its shape
    (its memory freed once nothing else holds it), each module keeping its names."""
    stand_ins: dict[int, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in list(module._parameters.items()):
            if param is None or state.local(prefix + name):
                continue
            if id(param) not in stand_ins:
                stand_ins[id(param)] = nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
                )
            module._parameters[name] = stand_ins[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not state.local(prefix + name):
                module._buffers[name] = torch.empty_like(buffer, device="meta")


def bind_optimizer(
    optimizer: torch.optim.Optimizer,
    replaced: Mapping[int, torch.Tensor],
    local: set[int],
    state: PipelineState,
) -> None:
    """Point ``optimizer`` at this rank's set-up parameters only (``replaced``: id of each
    original -> its set-up successor or meta stand-in; ``local``: ids of the successors this
    rank trains), remembering where each sat. State it held (a checkpoint loaded before the
    set-up) is kept for this rank's parameters, sliced like them."""
    saved = optimizer.state_dict() if optimizer.state else None
    index = 0
    state.global_index, state.global_groups, state.full_groups = [], [], []
    for group in optimizer.param_groups:
        indices, full, kept = [], [], []
        for param in group["params"]:
            now = replaced.get(id(param), param)
            indices.append(index)
            full.append(now)
            if id(now) in local:
                kept.append(now)
                state.global_index.append(index)
            index += 1
        group["params"] = kept
        state.global_groups.append(indices)
        state.full_groups.append(full)
    from collections import defaultdict

    optimizer.state = defaultdict(dict)
    if saved is not None:
        load_full_optimizer_state(optimizer, saved, state)


# -------------------------------------------------------------------- gathering
def _merge(part: dict[Any, Any], strategy: Any, keep_everywhere: bool) -> dict[Any, Any] | None:
    """Every rank's ``part`` (a dict) merged into one, on rank 0 (or, ``keep_everywhere``,
    on every rank); None on the ranks that keep nothing."""
    if keep_everywhere:
        parts: list[Any] | None = list(strategy.all_gather_object(part))
    else:
        parts = [None] * strategy.world_size if strategy.is_main else None
        dist.gather_object(part, parts, dst=0)
    if parts is None:
        return None
    merged: dict[Any, Any] = {}
    for each in parts:
        merged.update(each)
    return merged


def full_model_state(
    model: nn.Module, state: PipelineState, strategy: Any, *, rank0_only: bool
) -> dict[str, torch.Tensor]:
    """The model's full state (CPU tensors, its own keys and order), gathered from the stages."""
    entries = model.state_dict()
    mine = {}
    for key, value in entries.items():
        if state.local(key):
            full = _fsdp_state.gathered(value)  # among this stage's ranks, in key order
            if state.stage_root:
                mine[key] = full
    merged = _merge(mine, strategy, keep_everywhere=not rank0_only)
    if merged is None:
        return {}
    return {key: merged[key] for key in entries if key in merged}


def full_optimizer_state(
    optimizer: torch.optim.Optimizer, state: PipelineState, strategy: Any, *, rank0_only: bool
) -> dict[str, Any]:
    """The optimizer's full state, keyed as the user's optimizer over the whole model."""
    local = _fsdp_state.full_optimizer_state(optimizer)  # gathered among the stage's ranks
    mine = (
        {state.global_index[int(i)]: entries for i, entries in local["state"].items()}
        if state.stage_root
        else {}
    )
    merged = _merge(mine, strategy, keep_everywhere=not rank0_only)
    if merged is None:
        return {}
    return {"state": dict(sorted(merged.items())), "param_groups": _groups(optimizer, state)}


def _groups(optimizer: torch.optim.Optimizer, state: PipelineState) -> list[dict[str, Any]]:
    """The optimizer's param_groups as the user's optimizer over the whole model has them."""
    groups = optimizer.state_dict()["param_groups"]
    return [
        {**group, "params": list(indices)}
        for group, indices in zip(groups, state.global_groups, strict=True)
    ]


# -------------------------------------------------------------------- loading
def load_full_model_state(model: nn.Module, full: Mapping[str, Any], state: PipelineState) -> None:
    """This rank's stages' part of a full model state, each tensor sliced like its own."""
    current = model.state_dict()
    missing = sorted(set(current) - set(full))
    unexpected = sorted(set(full) - set(current))
    if missing or unexpected:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model).__name__}: missing keys "
            f"{missing}, unexpected keys {unexpected}"
        )
    model.load_state_dict(
        {
            key: _fsdp_state.like(value, current[key]) if isinstance(value, torch.Tensor) else value
            for key, value in full.items()
            if state.local(key)
        },
        strict=False,
    )


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer, full: Mapping[str, Any], state: PipelineState
) -> None:
    """This rank's part of a full optimizer state (keyed by the user's optimizer's order)."""
    saved = {int(index): entries for index, entries in full["state"].items()}
    per_param = {
        local: saved[index] for local, index in enumerate(state.global_index) if index in saved
    }
    _fsdp_state.load_full_optimizer_state(
        optimizer, {"state": per_param, "param_groups": _local_groups(optimizer, full)}
    )


def _local_groups(optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> list[Any]:
    """A full state's groups (their hyperparameters) over this rank's parameters."""
    own = optimizer.state_dict()["param_groups"]
    return [
        {**saved, "params": mine["params"]}
        for saved, mine in zip(full["param_groups"], own, strict=True)
    ]


# -------------------------------------------------------------------- sharded
def save_sharded(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: PipelineState,
    strategy: Any,
) -> dict[str, Any]:
    """Every rank writes its stages' slices (a collective); the entries of the checkpoint
    file (rank 0's): the whole model's and optimizer's stubs, in the one-process layout."""
    entries = model.state_dict()
    model_state = {k: v for k, v in entries.items() if state.local(k)}
    optim = optimizer.state_dict()
    by_global = {state.global_index[int(i)]: e for i, e in optim["state"].items()}
    tensors = {
        "model": model_state,
        "optimizer": {
            str(g): {k: v for k, v in e.items() if isinstance(v, torch.Tensor)}
            for g, e in by_global.items()
        },
    }
    hashed = _shard_files.write(folder, tensors, strategy.all_gather_object, strategy.rank)
    stubs = {g: {k: _shard_files.meta_of(v) for k, v in e.items()} for g, e in by_global.items()}
    merged = _merge(stubs if state.stage_root else {}, strategy, keep_everywhere=True) or {}
    return {
        _shard_files.DIGESTS: hashed,
        "model": {key: _shard_files.meta_of(value) for key, value in entries.items()},
        "optimizer": {
            "state": dict(sorted(merged.items())),
            "param_groups": _groups(optimizer, state),
        },
        _shard_files.KEY: folder.name,
    }


def load_sharded(
    payload: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: PipelineState,
) -> None:
    """This rank's stages' part of a sharded checkpoint, read into its own tensors."""
    _shard_files.refuse_deepspeed(payload)
    stub = payload.get("optimizer") or {"state": {}, "param_groups": []}
    saved_state = {int(i): e for i, e in stub["state"].items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_global = {
        index: {
            k: _shard_files.target_like(v, params[local]) for k, v in saved_state[index].items()
        }
        for local, index in enumerate(state.global_index)
        if index in saved_state
    }
    saved = payload["model"]
    model_state = {
        key: value for key, value in model.state_dict().items() if key in saved and state.local(key)
    }
    _shard_files.read_into(payload[_shard_files.KEY], model_state, by_global)
    model.load_state_dict(model_state, strict=False)
    if stub["param_groups"]:
        local = {
            position: by_global[index]
            for position, index in enumerate(state.global_index)
            if index in by_global
        }
        groups = _local_groups(optimizer, stub)
        optimizer.load_state_dict({"state": local, "param_groups": groups})


# -------------------------------------------------------------------- weights
def full_entry(
    key: str, entry: torch.Tensor, state: PipelineState, strategy: Any, *, keep: bool
) -> torch.Tensor | None:
    """One entry of the model's state in full, on every rank that keeps it: gathered among its
    stage's ranks, then sent from the stage's first rank to every rank (every rank calls this
    for the same keys in the same order)."""
    if state.local(key):
        full = _fsdp_state.gathered(entry)
    else:
        full = torch.empty(entry.shape, dtype=entry.dtype)
    device = strategy.device
    moved = full.to(device) if device.type == "cuda" else full
    dist.broadcast(moved, src=state.roots[state.owner[key]])
    return moved.cpu() if keep else None
