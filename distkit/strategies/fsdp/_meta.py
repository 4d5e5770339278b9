"""A model built on the meta device, materialised shard by shard: no rank holds it whole.

The model is sharded while it is still on meta (``fully_shard`` takes meta parameters), then
``to_empty`` gives each rank storage for its own slices only. Each module with parameters or
buffers of its own is then initialised as it would have been when the model was built on the
CPU: its own tensors, full size, on the CPU for a moment, filled by its ``reset_parameters()``
(the call every torch layer's constructor makes), in the order the modules were built, from
rank 0's random state. Each rank keeps its slice and drops the rest, so the peak is one
module's tensors, and the weights equal those of the same model built normally after the same
``torch.manual_seed``.

A module whose ``reset_parameters()`` does not set all of its own tensors (or that has none)
cannot be initialised so: it is refused, naming it, rather than trained from uninitialised
memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from distkit.errors import ConfigurationError

#: what an integer buffer holds until reset_parameters() sets it
_UNSET_INT = -(2**31) + 7


def on_meta(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the meta device (and it has some)."""
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def materialize(
    model: nn.Module, device: torch.device, rng_state: torch.Tensor, *, main: bool
) -> None:
    """Give ``model`` (sharded or not) storage on ``device`` and initialise every module as
    the normal build would have, from ``rng_state`` (rank 0's). Rank 0 (``main``) advances its
    own random state as the normal build did; the others keep theirs."""
    model.to_empty(device=device)
    with _random_state(rng_state, keep=main):
        for module in model.modules():
            _initialise(module, device)


@contextlib.contextmanager
def _random_state(state: torch.Tensor, *, keep: bool) -> Iterator[None]:
    if keep:
        torch.set_rng_state(state)
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


def _initialise(module: nn.Module, device: torch.device) -> None:
    own = {
        **{n: p for n, p in module._parameters.items() if p is not None},
        **{n: b for n, b in module._buffers.items() if b is not None},
    }
    if not own:
        return
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ConfigurationError(
            f"the model was built on the meta device, and its {type(module).__name__} holds "
            f"{', '.join(sorted(own))} but has no reset_parameters(): distkit cannot give them "
            "their initial values. Give the module a reset_parameters() that sets them, or "
            "build the model on the CPU"
        )
    full = {name: _unset(tensor) for name, tensor in own.items()}
    for name, blank in full.items():
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(blank, requires_grad=own[name].requires_grad)
        else:
            module._buffers[name] = blank
    try:
        with torch.no_grad():
            reset()
        tables = (module._parameters, module._buffers)
        values = {name: next(t[name] for t in tables if name in t) for name in full}
    finally:
        for name, tensor in own.items():
            if name in module._parameters:
                module._parameters[name] = tensor  # type: ignore[assignment]
            else:
                module._buffers[name] = tensor
    for name, made in values.items():
        assert made is not None
        value: torch.Tensor = made
        if _still_unset(value):
            raise ConfigurationError(
                f"the model was built on the meta device, and {type(module).__name__}"
                f".reset_parameters() does not set its {name!r}: distkit cannot give it its "
                "initial value. Set it in reset_parameters(), or build the model on the CPU"
            )
        _keep_slice(own[name], value.detach(), device)


def _unset(tensor: torch.Tensor) -> torch.Tensor:
    """A full-size CPU tensor marked as not yet set (NaN, or an unlikely integer)."""
    shape, dtype = tensor.shape, tensor.dtype  # a DTensor's shape is the global one
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    return torch.full(shape, _UNSET_INT, dtype=dtype)


def _still_unset(value: torch.Tensor) -> bool:
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return bool(torch.isnan(value).any())
    if value.dtype == torch.bool:
        return False
    return bool((value == _UNSET_INT).any())


def _keep_slice(target: torch.Tensor, full: torch.Tensor, device: torch.device) -> None:
    """This rank's part of ``full`` into ``target`` (a DTensor's local slice, or all of it)."""
    with torch.no_grad():
        if hasattr(target, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            dtensor: Any = target
            piece = distribute_tensor(
                full.to(device), dtensor.device_mesh, dtensor.placements, src_data_rank=None
            )
            dtensor.to_local().copy_(piece.to_local())
        else:
            target.copy_(full.to(device))
