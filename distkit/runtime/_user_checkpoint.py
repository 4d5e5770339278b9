"""``rt.save(path, state)`` / ``rt.load(path, state)``: a user loop's checkpoint.

``state`` maps names to what the loop holds: set-up models and optimizers (their full state,
gathered where the backend shards it, in the user's own keys), loaders (how far the loop
got), and plain values (numbers, strings, tensors, lists and dicts of them). The file is a
distkit checkpoint (atomic, with a digest, loadable weights-only) written by rank 0 after
every rank took part, in the one layout of every distkit checkpoint
(:mod:`distkit.checkpoint._layout`): each entry's state at the top level under its name
(``torch.load(path)["model"]`` is the model's weights), and distkit's records under
``"distkit"``: every rank's RNG states and the loss scaler's, so a resumed loop continues
exactly, at any world size, and each entry's kind. ``rt.load`` reads a Trainer's checkpoint
too (its ``model`` and ``optimizer`` entries, and its plain ones).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import checkpoint as ckpt
from distkit._validate import check_flags, check_path
from distkit.checkpoint import _layout, _shard_files
from distkit.checkpoint._fits import model_misfits
from distkit.errors import CheckpointError, ConfigurationError
from distkit.runtime import _agreement
from distkit.runtime._background_save import PendingSave
from distkit.runtime._loader import RuntimeLoader
from distkit.runtime._rank_zero_write import write_on_rank_zero
from distkit.runtime._set_up import SetUpModel, SetUpOptimizer
from distkit.strategies.capabilities import fp32

if TYPE_CHECKING:
    from distkit.runtime._runtime import Runtime

MODEL, OPTIMIZER, LOADER, VALUE = "model", "optimizer", "loader", "value"
#: the kinds of a Trainer's checkpoint's entries that rt.load takes (the rest are values)
_TRAINER_KINDS = {"model": MODEL, "optimizer": OPTIMIZER}


def kind_of(value: object) -> str:
    if isinstance(value, SetUpModel):
        return MODEL
    if isinstance(value, SetUpOptimizer):
        return OPTIMIZER
    if isinstance(value, RuntimeLoader):
        return LOADER
    if isinstance(value, (nn.Module, torch.optim.Optimizer)):
        raise ConfigurationError(
            f"rt.save/rt.load take the {type(value).__name__} that rt.setup returned (its "
            "state is gathered and restored through the backend), got the one you built: "
            "pass what rt.setup returned"
        )
    return VALUE


def _checked_state(state: object, call: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise ConfigurationError(
            f"{call} takes a dict of name -> what to save (set-up models and optimizers, "
            f"loaders, plain values), got {type(state).__name__}"
        )
    if ckpt.RECORDS in state:
        raise ConfigurationError(
            f"{call}'s entry name {ckpt.RECORDS!r} is reserved: a checkpoint keeps distkit's "
            "own records under it. Name the entry otherwise"
        )
    return state


def save_state(
    runtime: Runtime, path: str | os.PathLike[str], state: object, *, blocking: bool = True
) -> PendingSave | None:
    """Write ``state`` to ``path`` (atomically, by rank 0). A collective. ``blocking=False``:
    staged, then persisted in the background; returns its handle."""
    state = _checked_state(state, "rt.save")
    strategy = runtime.strategy
    options = runtime.options.storage_options

    def prepare() -> _agreement.Proposal[dict[str, str]]:
        check_path("path", path, "a file path (str or os.PathLike)")
        check_flags(blocking=blocking)
        if strategy.is_main and not ckpt.is_url(path) and Path(path).is_dir():
            raise CheckpointError(
                f"{path} is a folder; a checkpoint is a file: pass a path such as "
                f"{Path(path) / 'model.pt'}"
            )
        kinds = {key: kind_of(value) for key, value in state.items()}
        agreed = {
            "entries": ", ".join(f"{k}: {v}" for k, v in kinds.items()),
            "blocking": str(blocking),
        }
        return _agreement.Proposal(agreed, kinds, shared={"rng": ckpt.rng_state()})

    kinds, ranks = _agreement.exchange(strategy, "rt.save", prepare)
    runtime._wait_for_save()  # never two in flight (every rank is here: agreed)
    ranks = _agreement.per_data_rank(strategy, ranks)
    entries: dict[str, Any] = {}
    for key, value in state.items():  # every rank, in the same order: gathers are collectives
        kind = kinds[key]
        if kind == MODEL:
            entries[key] = fp32(strategy.state_io.model_state_dict(value.module, rank0_only=True))
        elif kind == OPTIMIZER:
            entries[key] = strategy.state_io.optimizer_state_dict(value.optimizer, rank0_only=True)
        elif kind == LOADER:
            entries[key] = value.state_dict()
        else:
            entries[key] = value
    payload = None
    if strategy.is_main:
        records = {
            "format": ckpt.FORMAT,
            "version": ckpt.VERSION,
            "producer": ckpt.producer(
                strategy.name, strategy.options.precision, strategy.world_size
            ),
            "scaler": strategy.precision.state_dict(),
            _layout.KINDS: kinds,
            "ranks": ranks,
        }
        payload = {**entries, ckpt.RECORDS: records}
    write = lambda ready: ckpt.atomic_save(ready, path, storage_options=options)  # noqa: E731
    if not blocking:
        models = {key: state[key].module for key, kind in kinds.items() if kind == MODEL}
        return PendingSave.start(strategy, payload, write, f"the checkpoint {path}", models)
    write_on_rank_zero(strategy, payload, write)
    return None


def load_state(runtime: Runtime, path: str | os.PathLike[str], state: object) -> dict[str, Any]:
    """Restore ``state``'s objects in place from ``path``; returns the file's other values
    (the plain ones, by name). Every rank reads the file; no collective."""
    state = _checked_state(state, "rt.load")
    strategy = runtime.strategy
    if runtime._pending_save is not None:  # every rank holds it: no read of a file in flight
        _agreement.exchange(strategy, "rt.load", lambda: _agreement.Proposal({}, None))
        runtime._wait_for_save()
    entries, records = ckpt.load_entries(
        path, map_location=strategy.device, storage_options=runtime.options.storage_options
    )
    if _layout.written_by_trainer(records):  # its model and optimizer, its plain entries
        if records.get(_shard_files.KEY) is not None:
            raise CheckpointError(
                f"{path} is a Trainer's sharded checkpoint (its weights are in the shards "
                "folder beside it): load it with trainer.load_checkpoint(path), or save a "
                "full one (FSDPStrategy(checkpoint='full'))"
            )
        kinds = {key: _TRAINER_KINDS.get(key, VALUE) for key in entries}
    else:
        kinds = records[_layout.KINDS]
    # every entry checked before any is loaded: a refusal leaves the loop's objects as they were
    for key, value in state.items():
        kind = kind_of(value)
        if key not in entries:
            raise CheckpointError(
                f"{path} holds no {key!r} (it holds {', '.join(entries) or 'nothing'}): "
                "load the names that rt.save wrote"
            )
        if kinds.get(key) != kind:
            raise CheckpointError(
                f"{path} saved {key!r} as a {kinds.get(key)}, and rt.load was given a {kind} for it"
            )
        if kind == MODEL:
            module = value.module
            found = ckpt.strip_wrapper_prefix(entries[key])
            problems = model_misfits(found, strategy.state_io.shapes(module), module)
            if problems:
                raise CheckpointError(
                    f"{path}: {key!r} does not fit this model: {'; '.join(problems[:5])}. "
                    "Nothing was loaded. Load it into the model it was saved from (same "
                    "layers, sizes and dtypes)"
                )
    for key, value in state.items():
        kind = kind_of(value)
        if kind == MODEL:
            strategy.state_io.load_model_state_dict(value.module, entries[key])
        elif kind == OPTIMIZER:
            strategy.state_io.load_optimizer_state_dict(value.optimizer, entries[key])
            value.follow_loaded_state()
        elif kind == LOADER:
            value.load_state_dict(entries[key])
    ranks = records.get("ranks")
    if isinstance(ranks, list) and len(ranks) == strategy.data_world_size:
        # this rank's own, where it exists (a tensor-parallel group's ranks share one)
        ckpt.set_rng_state(ranks[strategy.data_rank]["rng"])
    strategy.precision.load_state_dict(records.get("scaler") or {})
    return {key: value for key, value in entries.items() if kinds.get(key) == VALUE}
