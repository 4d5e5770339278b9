"""torch's default collate, with its one common failure explained: samples that cannot be
stacked (token sequences of different lengths), where torch says only "stack expects each
tensor to be equal size" and names neither the field nor the fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from distkit.errors import ConfigurationError


def explained_collate(batch: list[Any]) -> Any:
    """``default_collate(batch)``; samples of other shapes get a ConfigurationError naming
    the field and the fix (a module-level function: DataLoader workers pickle it)."""
    try:
        return default_collate(batch)
    except RuntimeError as exc:
        if "equal size" not in str(exc):
            raise
        field = ragged_field(batch)
        where = f" (field {field!r})" if field else ""
        raise ConfigurationError(
            f"the samples of a batch cannot be stacked into one tensor{where}: {exc}. "
            "Samples of different lengths (token sequences, say) need a collate_fn that pads "
            "them: pass a DataLoader(dataset, batch_size=..., collate_fn=...) instead of the "
            "dataset (transformers' DataCollatorWithPadding, or a function of your own), or "
            "give every sample the same length"
        ) from None


def ragged_field(batch: Sequence[Any]) -> str | None:
    """The first field (a dict key, or a tuple position) whose tensors differ in shape."""
    first = batch[0] if batch else None
    if isinstance(first, Mapping):
        fields: list[tuple[str, list[Any]]] = [
            (str(key), [sample[key] for sample in batch]) for key in first
        ]
    elif isinstance(first, (tuple, list)):
        fields = [(str(i), [sample[i] for sample in batch]) for i in range(len(first))]
    else:
        return None
    for name, values in fields:
        shapes = {tuple(v.shape) for v in values if isinstance(v, torch.Tensor)}
        if len(shapes) > 1:
            return name
    return None
