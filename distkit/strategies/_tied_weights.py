"""Tied weights in a model built on the meta device: which module's initial values a shared
parameter takes, and how the model is given storage without untying it.

The normal build keeps the values of the constructor that made a parameter, whichever module
it is handed to afterwards: ``head.weight = emb.weight`` keeps the embedding's initial
values, ``emb.weight = head.weight`` the output layer's. A meta build has no values to tell
them apart, so ``distkit.init_empty()`` records, as the model is built, which parameters each
module made (:func:`recording_makers`, torch's public parameter-registration hook); a model
built under a bare ``torch.device("meta")`` takes those of the first module holding it.

``Module.to_empty()`` makes a new parameter for every module that holds one, so the two
holders of a tied weight each got their own, and the optimizer built over the meta
parameters held neither: :func:`keeping_parameters` gives each parameter new storage in
place (``torch.utils.swap_tensors``), the object kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

#: the module attribute that names the parameters it made itself, not one it was handed (a
#: tied output layer holds the embedding's): recorded by :func:`recording_makers`
MADE = "_distkit_made_parameters"


def homes(model: nn.Module) -> dict[int, int]:
    """For each tensor two modules hold (tied), the module whose initial values it takes:
    the one that made it, where ``distkit.init_empty()`` recorded that (the normal build
    keeps the values of the constructor that made the parameter, whichever module it was
    then handed to: ``head.weight = emb.weight`` keeps the embedding's, ``emb.weight =
    head.weight`` the output layer's); else the first that holds it, in ``modules()``
    order. By ``id`` of the tensor and of the module."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None:
                    holders.setdefault(id(tensor), []).append(module)
    home: dict[int, int] = {}
    for key, modules in holders.items():
        if len(modules) < 2:
            continue
        makers = [m for m in modules if _made_here(m, key)]
        home[key] = id((makers or modules)[0])
    return home


def _made_here(module: nn.Module, key: int) -> bool:
    made = module.__dict__.get(MADE, ())
    return any(id(module._parameters.get(name)) == key for name in made)


@contextlib.contextmanager
def recording_makers() -> Iterator[None]:
    """Inside it (``distkit.init_empty()``), each module records which of its parameters it
    made (registered first there) and which it was handed (registered elsewhere before), so
    a tied weight built on meta takes the values of the constructor that made it. The hook
    is torch's public one, removed on exit."""
    seen: dict[int, torch.Tensor] = {}  # held until the exit: no id is reused meanwhile

    def hook(module: nn.Module, name: str, param: torch.Tensor | None) -> None:
        if param is None or module._parameters.get(name) is param:
            return
        made: set[str] = module.__dict__.setdefault(MADE, set())
        if id(param) in seen:
            made.discard(name)  # handed another module's parameter
        else:
            seen[id(param)] = param
            made.add(name)

    handle = nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        seen.clear()


@contextlib.contextmanager
def keeping_parameters() -> Iterator[None]:
    """``model.to_empty()`` (any ``Module._apply``) inside keeps each parameter object and
    gives it new storage (``torch.utils.swap_tensors``): by default it makes a new parameter
    for each module that holds one, which unties tied weights (the embedding and the output
    layer each got their own) and leaves the optimizer holding the old ones. torch's flag is
    put back as it was."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
