"""Which submodules FSDP2 shards as units of their own by default.

Each top-level child that holds parameters is a unit (all-gathered for its forward and freed
after), unless it shares a parameter with the rest of the model: FSDP2 manages a parameter in
one unit only, and a language model's output layer tied to its embedding
(``lm_head.weight is transformer.wte.weight``) sits in two top-level children. Such a child
is not a unit (its shared parameters stay with the root, which is gathered for the whole
forward); instead each block of its module lists (a transformer's layers, the bulk of its
parameters) that shares nothing becomes one. A top-level module list or dict (no forward of
its own, which ``fully_shard`` refuses) has its items as units instead.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

ShardPolicy = Callable[[str, nn.Module], bool]
#: containers without a forward of their own, which fully_shard refuses as a unit
_NO_FORWARD = (nn.ModuleList, nn.ModuleDict)


def default_units(model: nn.Module) -> set[str]:
    """The names of the submodules the default policy shards (see the module docstring)."""
    users: dict[int, set[str]] = {}  # a parameter -> the names it goes by in the model
    for name, parameter in model.named_parameters(remove_duplicate=False):
        users.setdefault(id(parameter), set()).add(name)

    def self_contained(prefix: str, module: nn.Module) -> bool:
        """Every parameter of ``module`` is used under ``prefix`` only."""
        return all(
            all(name.startswith(prefix + ".") for name in users[id(p)])
            for p in module.parameters(recurse=True)
        )

    units: set[str] = set()
    for name, child in model.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if self_contained(name, child):
            if not isinstance(child, _NO_FORWARD):
                units.add(name)
                continue
            # fully_shard refuses a container without a forward of its own (a model's
            # top-level ``self.layers = nn.ModuleList(...)``): its items are the units
            units.update(
                f"{name}.{item}" for item, block in child.named_children()
                if any(True for _ in block.parameters())
            )  # fmt: skip
            continue
        for inner, module in child.named_modules(prefix=name):
            if not isinstance(module, nn.ModuleList):
                continue
            for index, block in enumerate(module):
                block_name = f"{inner}.{index}"
                if any(True for _ in block.parameters()) and self_contained(block_name, block):
                    units.add(block_name)
    # a block's own module lists are inside its unit already
    return {n for n in units if not any(n.startswith(u + ".") for u in units if u != n)}


def policy_of(units: set[str]) -> ShardPolicy:
    """A policy that shards exactly ``units``."""
    return lambda name, module: name in units
