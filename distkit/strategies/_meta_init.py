"""A model built on the meta device, given the initial values the normal build would have.

A meta model has shapes and dtypes but no values. Each module with parameters or buffers of
its own is initialised here as it would have been when the model was built on the CPU: its
own tensors, full size, on the CPU for a moment, filled by its ``reset_parameters()`` (the call
every torch layer's constructor makes), in the order the modules were built, from rank 0's
random state. A strategy that shards (fsdp, DeepSpeed stage 3) keeps this rank's part of each
module's values and drops the rest before the next module, so the peak is one module's
tensors, and the weights equal those of the same model built normally after the same
``torch.manual_seed``. The random state is the one the build started from (recorded by
:func:`recording_rng` inside ``distkit.init_empty()``), so what draws from torch's generator
between the build and the set-up (a Runtime's or Trainer's seeding) changes nothing.

A module whose ``reset_parameters()`` does not set all of its own tensors (or that has none)
cannot be initialised so: it is refused, naming it, rather than trained from uninitialised
memory. A tensor two modules share (tied weights) is given its values once, those of the
module that made it (see :mod:`distkit.strategies._tied_weights`), and stays one tensor.

Weights ``load_weights`` recorded for the meta model (:mod:`distkit.checkpoint.
_pending_weights`) are its values instead: each recorded tensor is read from its file, and a
module whose tensors all come from the files is not initialised at all (no
``reset_parameters()``, no random draws; it needs neither, and a layer without one, such as
transformers' ``Conv1D``, loads). A module with tensors the files lack (``strict=False``, a
new head) is initialised for those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from distkit.checkpoint._pending_weights import StoredTensor
from distkit.errors import ConfigurationError
from distkit.strategies import _tied_weights

#: what an integer buffer holds until reset_parameters() sets it
_UNSET_INT = -(2**31) + 7

#: a tensor's initial value: made by ``reset_parameters()``, or where it is in a weights file
Value = torch.Tensor | StoredTensor
#: ``keep(module, own, values)``: store a module's full initial ``values`` (by name) into its
#: ``own`` tensors (by name; meta, or this rank's storage), keeping this rank's part
Keep = Callable[[nn.Module, dict[str, torch.Tensor], dict[str, Value]], None]


def on_meta(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the meta device (and it has some)."""
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def initialise(
    model: nn.Module,
    rng_state: torch.Tensor,
    keep: Keep,
    *,
    main: bool,
    stored: Mapping[str, StoredTensor] | None = None,
) -> None:
    """Each module's initial values, module by module in build order, from ``rng_state``
    (rank 0's), handed to ``keep``. Rank 0 (``main``) advances its own random state as the
    normal build did; the others keep theirs. ``stored``: the tensors ``load_weights``
    recorded, by the model's names, handed to ``keep`` as they are (each keeper reads what it
    keeps); a module whose tensors they all are is not initialised."""
    given: set[int] = set()  # a tensor two modules hold (tied) is given its values once
    home = _tied_weights.homes(model)
    with _random_state(rng_state, keep=main):
        for prefix, module in model.named_modules():
            own = {
                **{n: p for n, p in module._parameters.items() if p is not None},
                **{n: b for n, b in module._buffers.items() if b is not None},
            }
            if not own:
                continue
            new = [
                n
                for n in own
                if id(own[n]) not in given and home.get(id(own[n]), id(module)) == id(module)
            ]
            values: dict[str, Value]
            if stored is None:  # draws for every tensor, as the build did
                values = dict(_initial_values(module, own))
            else:
                dot = f"{prefix}." if prefix else ""
                values = {n: stored[dot + n] for n in new if dot + n in stored}
                unset = [n for n in new if n not in values]
                if unset:  # the files lack some: those are initialised
                    made = _initial_values(module, own, check=unset)
                    values.update({n: made[n] for n in unset})
            fresh = {n: values[n] for n in new}
            given.update(id(own[n]) for n in fresh)
            if fresh:
                keep(module, {n: own[n] for n in fresh}, fresh)


def full(value: Value) -> torch.Tensor:
    """``value`` as a full tensor: read from its file where it is stored."""
    return value.read() if isinstance(value, StoredTensor) else value


def materialise(model: nn.Module, device: torch.device, stored: Mapping[str, StoredTensor]) -> None:
    """The whole meta ``model`` given storage on ``device`` and its values: the ``stored``
    weights, any tensor they lack by its module's ``reset_parameters()`` from this process's
    random state. Each parameter and buffer stays the object it was (ties, and the optimizer
    built over the meta parameters, hold)."""

    def keep(module: nn.Module, own: dict[str, torch.Tensor], values: dict[str, Value]) -> None:
        with torch.no_grad():
            for name, value in values.items():
                target = own[name]
                made = full(value).to(device, target.dtype)
                if name in module._parameters:
                    made = nn.Parameter(made, requires_grad=target.requires_grad)
                torch.utils.swap_tensors(target, made)

    initialise(model, rng_at_build(model), keep, main=True, stored=stored)


#: a module's attribute: torch's random state where the ``init_empty()`` block that built it
#: began (what the normal build would have drawn its initial values from)
_BUILT_FROM = "_distkit_rng_at_build"


@contextlib.contextmanager
def recording_rng() -> Iterator[None]:
    """Inside it (``distkit.init_empty()``), each module that registers a parameter or a
    buffer records the random state at the block's start. torch's public hooks, removed on
    exit."""
    state = torch.get_rng_state()

    def hook(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
        module.__dict__.setdefault(_BUILT_FROM, state)

    handles = [
        nn.modules.module.register_module_parameter_registration_hook(hook),
        nn.modules.module.register_module_buffer_registration_hook(hook),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def rng_at_build(model: nn.Module) -> torch.Tensor:
    """The random state ``model``'s meta build began from (its first module's that recorded
    one), else torch's current state."""
    for module in model.modules():
        state = module.__dict__.get(_BUILT_FROM)
        if state is not None:
            return state
    return torch.get_rng_state()


@contextlib.contextmanager
def _random_state(state: torch.Tensor, *, keep: bool) -> Iterator[None]:
    if keep:
        torch.set_rng_state(state)
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


def _initial_values(
    module: nn.Module, own: dict[str, torch.Tensor], check: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """``module.reset_parameters()`` run on full-size CPU stand-ins for its ``own`` tensors;
    the module is left holding ``own`` again. ``check``: the names it must set (default:
    all; the others come from weights files)."""
    needed = sorted(own if check is None else check)
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        lacking = "" if check is None else " (not in the weights load_weights recorded)"
        raise ConfigurationError(
            f"the model was built on the meta device, and its {type(module).__name__} holds "
            f"{', '.join(needed)}{lacking} but has no reset_parameters(): distkit cannot give "
            "them their initial values. Give the module a reset_parameters() that sets them, "
            "load weights that hold them, or build the model on the CPU"
        )
    blanks = {name: _unset(tensor) for name, tensor in own.items()}
    for name, blank in blanks.items():
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(blank, requires_grad=own[name].requires_grad)
        else:
            module._buffers[name] = blank
    try:
        with torch.no_grad():
            reset()
        tables = (module._parameters, module._buffers)
        made = {name: next(t[name] for t in tables if name in t) for name in blanks}
    finally:
        for name, tensor in own.items():
            if name in module._parameters:
                module._parameters[name] = tensor  # type: ignore[assignment]
            else:
                module._buffers[name] = tensor
    values: dict[str, torch.Tensor] = {}
    for name, value in made.items():
        if name not in needed:
            continue
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
