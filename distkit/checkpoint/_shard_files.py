"""Sharded checkpoints: the model and optimizer tensors as torch.distributed.checkpoint shards.

For models whose full training state is too big to gather in one process: each rank writes
its own slices, no rank holds the whole. The shards go to a folder beside the checkpoint file
(``<file>.<token>.shards``, on a file system every rank can write); the file holds the rest as
usual, and the model and optimizer entries as meta tensors (names, shapes and dtypes, no data),
so the checks a resume makes first (does it fit this model?) work unchanged.

Loading reads into the tensors the model and optimizer have now: DTensors sharded over another
number of ranks (torch.distributed.checkpoint reslices), or plain tensors (a world of one, or
any other strategy). It needs no collective: each rank reads the slices it holds.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit.checkpoint import _digest
from distkit.errors import CheckpointError

#: the payload key naming the shards folder (relative in the file, absolute once loaded)
KEY = "shards"
#: the payload key of ``{shard file name: digest}`` (checked by distkit.checkpoint.load)
DIGESTS = "shard_digests"
#: files a backend puts beside its shards that no resume reads (DeepSpeed's conversion
#: script): never hashed, and one that is gone does not make the checkpoint damaged
HELPERS = frozenset({"zero_to_fp32.py"})
#: the payload key marking a shards folder of DeepSpeed's own format (``DeepSpeedStrategy(
#: checkpoint="sharded")``), which torch.distributed.checkpoint cannot read
DEEPSPEED = "deepspeed_shards"
_FOLDER = re.compile(r"(?P<file>.+)\.(?P<token>[0-9a-f]{12})\.shards")


def folder_for(path: Path | str, token: str) -> Path:
    """Where the shards of the checkpoint file ``path`` go (``token``: 12 hex digits).

    Raises:
        CheckpointError: ``path`` is a URL: shards are written to a file system every rank
            can write (object stores: not yet).
    """
    if isinstance(path, str) and "://" in path:
        raise CheckpointError(
            f"a sharded checkpoint to {path}: distkit writes sharded checkpoints to a local "
            "or shared file system only (not yet to object stores). Save full checkpoints "
            "there (checkpoint='full', the default), or pass a checkpoint_dir on a shared "
            "file system"
        )
    path = Path(path)
    return path.parent / f"{path.name}.{token}.shards"


def is_sharded(payload: dict[str, Any]) -> bool:
    return isinstance(payload.get(KEY), str)


def save(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    gather: Callable[[Any], list[Any]],
    rank: int,
) -> dict[str, Any]:
    """Write this rank's shards (a collective: every rank calls it with the same folder).

    Each rank hashes the files it wrote; ``gather`` (the strategy's ``all_gather_object``)
    brings every rank's digests together. Returns the checkpoint's ``model``, ``optimizer``,
    ``shards`` and ``shard_digests`` entries.
    """
    model_state = model.state_dict()
    optim_state = optimizer.state_dict()
    tensors = {
        "model": model_state,
        "optimizer": {
            str(index): {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
            for index, entries in optim_state["state"].items()
        },
    }
    hashed = write(folder, tensors, gather, rank)
    return {
        DIGESTS: hashed,
        "model": {key: meta_of(value) for key, value in model_state.items()},
        "optimizer": {
            "state": {
                index: {k: meta_of(v) for k, v in entries.items()}
                for index, entries in optim_state["state"].items()
            },
            "param_groups": optim_state["param_groups"],
        },
        KEY: folder.name,
    }


def write(
    folder: Path, tensors: dict[str, Any], gather: Callable[[Any], list[Any]], rank: int
) -> dict[str, str]:
    """Write ``tensors`` (``{"model": ..., "optimizer": {index: {name: tensor}}}``, this
    rank's) as torch.distributed.checkpoint shards (a collective); every file's digest."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=folder)
    hashed: dict[str, str] = {}
    for part in gather(_digest.file_digests(folder, _written_by(folder, rank))):
        hashed.update(part)
    # a file no rank claimed (a torch that names its files otherwise): hashed here
    hashed.update(_digest.file_digests(folder, _files(folder) - hashed.keys()))
    return hashed


def _files(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir() if entry.is_file()}


def _written_by(folder: Path, rank: int) -> set[str]:
    """The files of ``folder`` that ``rank`` wrote: torch.distributed.checkpoint names a
    rank's data files ``__<rank>_<n>.distcp``, and rank 0 (its coordinator) writes
    ``.metadata``."""
    present = _files(folder)
    mine = {name for name in present if name.startswith(f"__{rank}_")}
    return mine | ({".metadata"} & present if rank == 0 else set())


def meta_of(value: Any) -> Any:
    """A tensor as a meta tensor of its (global) shape and dtype; other values as given."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")  # global shape
    return value


def refuse_deepspeed(payload: dict[str, Any]) -> None:
    """Raise where ``payload``'s shards are DeepSpeed's own: only its engine reads them."""
    mark = payload.get(DEEPSPEED)
    if mark:
        raise CheckpointError(
            "this checkpoint holds DeepSpeed's own sharded state, written by "
            f"DeepSpeedStrategy(stage={mark['stage']}, checkpoint='sharded') at world size "
            f"{mark['world_size']}, and only DeepSpeed reads it back, there. Resume it there; "
            "or turn it into full weights with the zero_to_fp32.py DeepSpeed put in its shards "
            "folder; or save with checkpoint='full' (the default), which resumes under any "
            "backend and world size"
        )


def load(payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read the shards of ``payload`` (loaded by :func:`distkit.checkpoint.load`) into the
    model's and the optimizer's own tensors, whatever their layout now."""

    refuse_deepspeed(payload)

    stub = payload.get("optimizer") or {"state": {}, "param_groups": []}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state = {
        index: {k: target_like(v, params[int(index)]) for k, v in entries.items()}
        for index, entries in stub["state"].items()
    }
    saved = payload["model"]
    model_state = {key: value for key, value in model.state_dict().items() if key in saved}
    read_into(payload[KEY], model_state, optim_state)
    model.load_state_dict(model_state, strict=False)  # state_dict tensors may be copies
    if stub["param_groups"]:
        optimizer.load_state_dict({"state": optim_state, "param_groups": stub["param_groups"]})


def read_full(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's and the optimizer's state of ``payload`` read whole from its shards, as
    plain CPU tensors in torch's ``state_dict`` forms (for a backend that loads full state;
    every rank reads all of it)."""

    refuse_deepspeed(payload)

    def blank(stub: Any) -> Any:
        if isinstance(stub, torch.Tensor):
            return torch.zeros(stub.shape, dtype=stub.dtype)
        return stub

    model_state = {key: blank(value) for key, value in payload["model"].items()}
    stub = payload.get("optimizer") or None
    state = (
        {
            index: {k: blank(v) for k, v in entries.items()}
            for index, entries in stub["state"].items()
        }
        if stub
        else {}
    )
    read_into(payload[KEY], model_state, state)
    optimizer = {"state": state, "param_groups": stub["param_groups"]} if stub else None
    return model_state, optimizer


def read_into(
    folder: str, model_state: dict[str, Any], optim_state: dict[Any, dict[str, Any]]
) -> None:
    """Fill the tensors of ``model_state`` and ``optim_state`` (by parameter index) from the
    shards in ``folder``, each as it is laid out (a DTensor: this rank's slices only)."""
    import torch.distributed.checkpoint as dcp

    tensors = {
        "model": {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)},
        "optimizer": {
            str(index): {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
            for index, entries in optim_state.items()
        },
    }
    with warnings.catch_warnings():
        # no_dist: each rank reads its own slices, so loading is no collective (torch warns
        # that it assumes a single process: it reads only what this process holds)
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(tensors, checkpoint_id=folder, no_dist=True)


def target_like(stub: Any, param: torch.Tensor) -> Any:
    """A tensor to read ``stub``'s data into: laid out like ``param`` where shaped like it."""
    if not isinstance(stub, torch.Tensor):
        return stub
    if stub.shape == param.shape:
        return torch.zeros_like(param, dtype=stub.dtype)  # a DTensor for a sharded parameter
    return torch.zeros(stub.shape, dtype=stub.dtype)


def sweep(folder: Path, keep: str | None = None, *, named_by: Callable[[Path], str | None]) -> None:
    """Remove shards folders in ``folder`` that no checkpoint file refers to any more.

    Those of checkpoints ``CheckpointFolder`` pruned, of saves that were killed, and of an
    earlier save to the same file name. ``keep`` is never removed (the save in progress).
    ``named_by(file)`` reads the shards folder a checkpoint file names (its :data:`KEY`);
    an unreadable file (``CheckpointError``) keeps its folder.
    """
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        match = _FOLDER.fullmatch(entry.name)
        if match is None or not entry.is_dir() or entry.name == keep:
            continue
        owner = folder / match["file"]
        if owner.is_file():
            try:
                if named_by(owner) == str(entry):
                    continue
            except CheckpointError:
                continue  # unreadable: leave both alone
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(entry)
