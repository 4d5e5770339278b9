"""Small functions on batches: moving them to a device, splitting and measuring them."""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from distkit.errors import ConfigurationError

_CPU = torch.device("cpu")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if device == _CPU and _on_cpu(batch):
        return batch  # what .to("cpu") would give back: the same tensors (every CPU step)
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    # tuples and lists before the mappings: most batches are, and those checks are ABCs'
    if isinstance(batch, (list, tuple)):
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*(to_device(v, device) for v in batch))
        return type(batch)(to_device(v, device) for v in batch)
    if isinstance(batch, MutableMapping):
        moved = copy.copy(batch)  # keeps the type and its extras (defaultdict's factory, ...)
        for key, value in batch.items():
            moved[key] = to_device(value, device)
        return moved
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _on_cpu(batch: Any) -> bool:
    """Whether ``batch`` is a CPU tensor or a tuple / list of them (one type check each:
    the batches of a CPU step, read without moving anything)."""
    kind = type(batch)
    if kind is torch.Tensor:
        return bool(batch.is_cpu)
    if kind is not tuple and kind is not list:
        return False
    for value in batch:  # noqa: SIM110 (a loop, not all(...): its generator costs more)
        if type(value) is not torch.Tensor or not value.is_cpu:
            return False
    return True


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, target)`` of a batch, or a clear error for any other shape of batch."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConfigurationError(
        f"a batch must be (inputs, target) when loss_fn is used, got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (list, tuple)) else ''}. Pass "
        "step_fn=lambda model, batch: loss to handle other batch layouts."
    )


def batch_size_of(batch: Any) -> int:
    """Length of the first tensor found in ``batch`` (its leading dimension)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    # tuples and lists first: most batches are, and the Mapping check is an ABC's (slower)
    if isinstance(batch, (list, tuple)):
        values: Any = batch
    elif isinstance(batch, Mapping):
        values = batch.values()
    else:
        return 0
    for value in values:
        size = batch_size_of(value)
        if size:
            return size
    return 0
