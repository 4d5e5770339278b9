"""``DeepSpeedStrategy(checkpoint="sharded")``: DeepSpeed's own checkpoint folder, for models
whose full state is too big to gather in one process.

Each rank writes its own ZeRO partitions with ``engine.save_checkpoint`` into a folder beside
the checkpoint file (``<file>.<token>.shards``, as fsdp's sharded checkpoints are named, so
pruning and the digests work alike); no rank gathers the model. The checkpoint file holds the
rest as usual, the model's entries as meta tensors of the full shapes (the resume's checks
work unchanged), and :data:`MARK`: the stage and world size the partitions were cut for.

DeepSpeed reads its folder back only into an engine of the same stage and world size: a
resume anywhere else is refused before anything is loaded, naming the ways out. The folder is
DeepSpeed's own, so its ``zero_to_fp32.py`` (copied into the folder) turns it into full
weights without distkit.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit import checkpoint as ckpt
from distkit.checkpoint import _digest, _shard_files
from distkit.errors import CheckpointError

#: the payload key of ``{"stage", "world_size", "tag"}``: a folder of DeepSpeed's own
MARK = _shard_files.DEEPSPEED
#: the checkpoint tag (DeepSpeed's subfolder) inside the shards folder
TAG = "distkit"
_OPTIMIZER_FILE = re.compile(r".*zero_pp_rank_(?P<rank>\d+)_.*")


def save(
    strategy: Any, engine: Any, model: nn.Module, path: Path | str, groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """Write this rank's partitions (a collective); returns the checkpoint's model, optimizer
    (its ``groups`` only, for the resume's checks), shards, digests and :data:`MARK` entries
    on rank 0, ``{}`` elsewhere."""
    where, token = strategy.broadcast((str(path), secrets.token_hex(6)), src=0)
    folder = _shard_files.folder_for(ckpt.where(where), token)
    if strategy.is_main:
        _shard_files.sweep(folder.parent, keep=folder.name, named_by=ckpt.shards_named_by)
    engine.save_checkpoint(str(folder), tag=TAG, client_state={}, save_latest=False)
    strategy.barrier()  # every rank's files are written before they are hashed
    hashed: dict[str, str] = {}
    for part in strategy.all_gather_object(_digests(folder, strategy.rank)):
        hashed.update(part)
    if not strategy.is_main:
        return {}
    return {
        "model": {  # names, full shapes and dtypes, no data (stage 3's are partitioned)
            key: torch.empty(
                getattr(value, "ds_shape", value.shape), dtype=value.dtype, device="meta"
            )
            for key, value in model.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)
        },
        # the state is in DeepSpeed's files, as its partitions; the groups let a resume check
        # that this is the optimizer it was saved from
        "optimizer": {"state": {}, "param_groups": groups},
        _shard_files.KEY: folder.name,
        _shard_files.DIGESTS: hashed,
        MARK: {"stage": strategy.stage, "world_size": strategy.world_size, "tag": TAG},
    }


def _digests(folder: Path, rank: int) -> dict[str, str]:
    """This rank's share of the folder's files to hash: its own optimizer partition files;
    rank 0 all the others too (the module's file, DeepSpeed's script)."""
    names = []
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        if file.name in _shard_files.HELPERS:
            continue  # DeepSpeed's conversion script: a resume never reads it
        match = _OPTIMIZER_FILE.fullmatch(file.name)
        if (match is not None and int(match["rank"]) == rank) or (match is None and rank == 0):
            names.append(str(file.relative_to(folder)))
    return _digest.file_digests(folder, names)


def check_loadable(payload: dict[str, Any], stage: int, world_size: int) -> None:
    """Refuse a folder of DeepSpeed's own where DeepSpeed cannot read it: another stage or
    another world size (another backend: ``_shard_files.refuse_deepspeed``)."""
    mark = payload[MARK]
    if (stage, world_size) != (mark["stage"], mark["world_size"]):
        try:
            _shard_files.refuse_deepspeed(payload)
        except CheckpointError as exc:
            raise CheckpointError(
                f"{exc} (this run: DeepSpeedStrategy(stage={stage}) at world size {world_size})"
            ) from None


def load(engine: Any, payload: dict[str, Any]) -> None:
    """Read DeepSpeed's folder into a set-up ``engine``: the module's weights, ZeRO's fp32
    partitions and the optimizer state (a collective)."""
    mark = payload[MARK]
    folder = Path(payload[_shard_files.KEY])
    loaded, _ = engine.load_checkpoint(
        str(folder),
        tag=mark["tag"],
        load_optimizer_states=True,
        load_lr_scheduler_states=False,  # distkit keeps the scheduler in its own file
    )
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not read its checkpoint in {folder}")
