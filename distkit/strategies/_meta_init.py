"""A model built on the meta device, given the initial values the normal build would have.

A meta model has shapes and dtypes but no values. Each module with parameters or buffers of
its own is initialised here as it would have been when the model was built on the CPU: its
own tensors, full size, on the CPU for a moment, filled by its ``reset_parameters()`` (the call
every torch layer's constructor makes), in the order the modules were built, from rank 0's
random state. A strategy that shards (fsdp, DeepSpeed stage 3) keeps this rank's part of each
module's values and drops the rest before the next module, so the peak is one module's
tensors, and the weights equal those of the same model built normally after the same
``torch.manual_seed``.

A module whose ``reset_parameters()`` does not set all of its own tensors (or that has none)
cannot be initialised so: it is refused, naming it, rather than trained from uninitialised
memory. A tensor two modules share (tied weights) takes the values of the first module that
holds it, in ``model.modules()`` order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from distkit.errors import ConfigurationError

#: what an integer buffer holds until reset_parameters() sets it
_UNSET_INT = -(2**31) + 7

#: ``keep(module, own, values)``: store a module's full initial ``values`` (by name) into its
#: ``own`` tensors (by name; meta, or this rank's storage), keeping this rank's part
Keep = Callable[[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]], None]


def on_meta(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the meta device (and it has some)."""
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def initialise(model: nn.Module, rng_state: torch.Tensor, keep: Keep, *, main: bool) -> None:
    """Each module's initial values, module by module in build order, from ``rng_state``
    (rank 0's), handed to ``keep``. Rank 0 (``main``) advances its own random state as the
    normal build did; the others keep theirs."""
    given: set[int] = set()  # a tensor two modules hold (tied) takes the first one's values
    with _random_state(rng_state, keep=main):
        for module in model.modules():
            own = {
                **{n: p for n, p in module._parameters.items() if p is not None},
                **{n: b for n, b in module._buffers.items() if b is not None},
            }
            if not own:
                continue
            values = _initial_values(module, own)  # draws for every tensor, as the build did
            fresh = {n: v for n, v in values.items() if id(own[n]) not in given}
            given.update(id(own[n]) for n in fresh)
            if fresh:
                keep(module, {n: own[n] for n in fresh}, fresh)


@contextlib.contextmanager
def _random_state(state: torch.Tensor, *, keep: bool) -> Iterator[None]:
    if keep:
        torch.set_rng_state(state)
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


def _initial_values(module: nn.Module, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module.reset_parameters()`` run on full-size CPU stand-ins for its ``own`` tensors;
    the module is left holding ``own`` again."""
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
        made = {name: next(t[name] for t in tables if name in t) for name in full}
    finally:
        for name, tensor in own.items():
            if name in module._parameters:
                module._parameters[name] = tensor  # type: ignore[assignment]
            else:
                module._buffers[name] = tensor
    values: dict[str, torch.Tensor] = {}
    for name, value in made.items():
        if value is None or _still_unset(value):
            raise ConfigurationError(
                f"the model was built on the meta device, and {type(module).__name__}"
                f".reset_parameters() does not set its {name!r}: distkit cannot give it its "
                "initial value. Set it in reset_parameters(), or build the model on the CPU"
            )
        values[name] = value.detach()
    return values


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
