"""Weights ``load_weights`` checked for a model on the meta device, kept until the set-up.

A meta tensor has no storage: a copy into it is lost (torch only warns). So ``load_weights``
checks the files as for any model (names, shapes, dtypes, digests), then records where each of
the model's tensors is in them, on the module it was given. The set-up that gives the model
storage (fsdp and HSDP: each rank its slices; DeepSpeed stage 3: each module as it is
partitioned; ddp, dp, horovod: the whole model) takes the record and reads each tensor as it
makes it, under fsdp only this rank's rows of it. Nothing is read twice and no rank holds the
whole model.

The record is plain data on the module (file paths and names), so it travels with a model
pickled to spawned processes; it is taken (removed) when it is applied.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from distkit.checkpoint import _safetensors as st
from distkit.errors import CheckpointError

#: the module attribute that holds a record
ATTRIBUTE = "_distkit_pending_weights"
FEATURE = "load_weights"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor in a safetensors file: read whole, or some rows of its first dimension."""

    file: Path
    key: str  # its name in the file
    shape: tuple[int, ...]
    #: the file's size and modification time when load_weights checked it
    stamp: tuple[int, int]

    def read(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor on the CPU in the file's dtype (``rows``: only ``[start, stop)`` of
        its first dimension), refused if the file changed since it was checked."""
        if file_stamp(self.file) != self.stamp:
            raise CheckpointError(
                f"{self.file} changed after load_weights checked it (its size or modification "
                "time differs): the weights recorded for the model on the meta device are no "
                "longer those that were checked. Call load_weights again, then set the model up"
            )
        safe_open = st.safetensors_torch(FEATURE).safe_open
        with safe_open(str(self.file), framework="pt") as handle:
            if rows is None:
                tensor: torch.Tensor = handle.get_tensor(self.key)
            else:
                tensor = handle.get_slice(self.key)[rows[0] : rows[1]]
        return tensor


@dataclass
class Record:
    """The tensors recorded for one module, by the module's own ``state_dict`` names."""

    tensors: dict[str, StoredTensor] = field(default_factory=dict)


def file_stamp(file: Path) -> tuple[int, int]:
    try:
        found = os.stat(file)
    except OSError as exc:
        raise CheckpointError(
            f"{file} is gone ({type(exc).__name__}: {exc.strerror or exc}): load_weights "
            "recorded it for a model on the meta device, to be read at the set-up. Keep the "
            "weights where they were until fit / rt.setup has run, or call load_weights again"
        ) from None
    return found.st_size, found.st_mtime_ns


def record(model: nn.Module, tensors: Mapping[str, StoredTensor]) -> None:
    """Keep ``tensors`` (by ``model``'s state_dict names) on ``model``; a later load of the
    same names replaces an earlier one's."""
    held = getattr(model, ATTRIBUTE, None)
    if not isinstance(held, Record):
        held = Record()
        model.__dict__[ATTRIBUTE] = held
    held.tensors.update(tensors)


def recorded(model: nn.Module) -> dict[str, StoredTensor]:
    """Every tensor recorded on ``model`` or its submodules, by ``model``'s names (a record
    on a submodule is prefixed with its name; one on the model itself comes first, so a
    submodule's, loaded into it on purpose, wins)."""
    found: dict[str, StoredTensor] = {}
    for prefix, module in model.named_modules():
        held = module.__dict__.get(ATTRIBUTE)
        if isinstance(held, Record):
            dot = f"{prefix}." if prefix else ""
            found.update({dot + name: tensor for name, tensor in held.tensors.items()})
    return found


def take(model: nn.Module) -> dict[str, StoredTensor]:
    """What :func:`recorded` returns, removed from the modules (applied once)."""
    found = recorded(model)
    forget(model)
    return found


def forget(model: nn.Module) -> None:
    """Drop the records on ``model`` and its submodules."""
    for module in model.modules():
        module.__dict__.pop(ATTRIBUTE, None)
