"""A batch's output as one value per sample: checked, moved to the CPU, split along dim 0.

A batch's output (what ``predict_fn`` returns) is a tree: tensors whose first dimension is
the batch, in mappings (``dict``, ``OrderedDict``, a ``transformers`` ``ModelOutput``),
tuples (namedtuples too) and lists of tensors, which split element-wise; a list that holds
something other than tensors (strings, dicts, per-sample tensors of different shapes) with
one item per sample is per-sample already (a detection model's list of dicts, decoded text).
Anything else at a leaf (a number, a string, ``None``, a 0-d tensor such as a loss) is not a
value per sample and is refused, naming where it sits.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from distkit.batch import to_device
from distkit.errors import ConfigurationError

_CPU = torch.device("cpu")
#: what a file of predictions may hold besides tensors and containers (weights_only loads it)
_PLAIN = (str, int, float, bool, type(None))


def batch_to_cpu(output: Any, size: int) -> Any:
    """``output`` (of a batch of ``size`` samples) checked and moved to the CPU, its tensors
    detached and holding no more memory than their values.

    Raises:
        ConfigurationError: where ``output`` holds no value per sample, or a leaf that is not.
    """
    if output is None:
        raise ConfigurationError(
            "predict_fn returned None; it must return the batch's output: a tensor whose first "
            "dimension is the batch (or a dict, tuple or list of them)"
        )
    moved, found = _to_cpu(output, size, "output")
    if not found:
        raise ConfigurationError(
            f"the output ({_kind(output)}) holds no value per sample: no tensor and no list "
            f"with one item per sample (the batch has {size})"
        )
    return moved


def _to_cpu(value: Any, size: int, where: str) -> tuple[Any, bool]:
    """(the value on the CPU, whether it holds a value per sample)."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 or value.shape[0] != size:
            shape = tuple(value.shape)
            raise ConfigurationError(
                f"{where} is a tensor of shape {shape}, not one value per sample: its first "
                f"dimension must be the batch's {size} samples. predict_fn must return the "
                "batch's output as is (not a mean, a loss, or a transposed tensor)"
            )
        return _compact(value.detach().to(_CPU)), True
    if isinstance(value, list) and _per_sample(value):
        if len(value) != size:
            raise ConfigurationError(
                f"{where} is a list of {len(value)} items ({_kind(value[0])}, ...), not one per "
                f"sample of the batch's {size}: a list that holds no tensors must hold one item "
                "per sample"
            )
        return [to_device(item, _CPU) for item in value], True
    if isinstance(value, (list, tuple)):
        pairs = [_to_cpu(part, size, f"{where}[{i}]") for i, part in enumerate(value)]
        return _rebuild(value, [part for part, _ in pairs]), any(found for _, found in pairs)
    if isinstance(value, Mapping):
        found = False
        moved = copy.copy(value) if isinstance(value, MutableMapping) else dict(value)
        for key, part in value.items():
            moved[key], holds = _to_cpu(part, size, f"{where}[{key!r}]")
            found = found or holds
        return moved, found
    raise ConfigurationError(
        f"{where} is {_kind(value)} ({value!r:.60}), not one value per sample: an output's "
        f"leaves must be tensors whose first dimension is the batch ({size} samples) or "
        "lists with one item per sample. Leave it out of predict_fn's output, or repeat it "
        "per sample"
    )


def split_batch_output(output: Any, size: int) -> list[Any]:
    """One value per sample of a checked output (see :func:`batch_to_cpu`): its tensors
    indexed along dim 0, per-sample lists item by item, containers rebuilt alike."""
    if isinstance(output, torch.Tensor):
        return list(output.unbind(0))
    if isinstance(output, list) and _per_sample(output):
        return list(output)
    if isinstance(output, (list, tuple)):
        columns = [split_batch_output(part, size) for part in output]
        return [_rebuild(output, [column[i] for column in columns]) for i in range(size)]
    assert isinstance(output, Mapping), f"unchecked output: {type(output).__name__}"
    split = {key: split_batch_output(part, size) for key, part in output.items()}
    samples = []
    for i in range(size):
        sample = copy.copy(output) if isinstance(output, MutableMapping) else {}
        for key in output:
            sample[key] = split[key][i]
        samples.append(sample)
    return samples


def plain(output: Any, where: str = "output") -> Any:
    """A checked output with plain containers only (dict, list, tuple), for a file that
    ``torch.load(weights_only=True)`` reads: a mapping becomes a dict, a namedtuple a tuple.

    Raises:
        ConfigurationError: where a per-sample item holds an object other than a tensor, a
            plain container, a string, a number or None.
    """
    if isinstance(output, (torch.Tensor, *_PLAIN)):
        return output
    if isinstance(output, list):
        return [plain(part, f"{where}[{i}]") for i, part in enumerate(output)]
    if isinstance(output, tuple):
        return tuple(plain(part, f"{where}[{i}]") for i, part in enumerate(output))
    if isinstance(output, Mapping):
        return {key: plain(part, f"{where}[{key!r}]") for key, part in output.items()}
    raise ConfigurationError(
        f"{where} is {_kind(output)}, which a file of predictions cannot hold (it is read "
        "with torch.load(weights_only=True), which runs no code): return tensors, strings, "
        "numbers, and lists, tuples and dicts of them, or gather the outputs instead of "
        "writing them (gather='all' or 'main')"
    )


def _per_sample(value: list[Any]) -> bool:
    """A list that is per-sample already: it holds something other than tensors."""
    return bool(value) and not all(isinstance(part, torch.Tensor) for part in value)


def _rebuild(like: list[Any] | tuple[Any, ...], parts: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple
        return type(like)(*parts)
    return type(like)(parts)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied where it views a larger storage (a slice of the logits): sending a
    view sends its whole storage."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _kind(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
