"""``compile="blocks"``: compile each repeated block of a model instead of the whole model.

A transformer is a stack of one block class (GPT-2's ``GPT2Block``, torch's
``TransformerEncoderLayer``): compiled one by one, dynamo traces the block's code once and
every other block of the class reuses the graph, so the compile time is one block's whatever
the depth, where a whole-model compile traces every layer. It is also what keeps a compiled
model working under backends that wrap it: each block is compiled in place
(``nn.Module.compile``: the module's call runs through ``torch.compile``), inside the DDP
wrapper, inside FSDP's units, under Horovod's hooks, so the wrapper's own code (DDP's
reducer, FSDP's all-gathers) stays outside the graphs.

**The blocks** are found the way FSDP's default units are (``distkit/strategies/fsdp/_units``):
the children of a module list (``nn.ModuleList`` or ``nn.Sequential``) of which at least two
share one class and hold submodules of their own (a stack of plain ``Linear`` layers is no
stack of blocks); the outermost such blocks where stacks nest. A model with none is refused
with the classes it has: ``compile=True`` compiles it whole.

In place, so ``state_dict`` keys, hooks and attribute access are the user's own; closing the
Runtime (the Trainer) gives each block its plain call back.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from distkit.errors import ConfigurationError, UnsupportedFeatureError

#: the containers whose children are a stack of blocks
_STACKS = (nn.ModuleList, nn.Sequential)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks :class:`BlockCompiler` compiles (see the module's docstring), in order."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, _STACKS):
            blocks = _blocks_of(module)
            if blocks:
                found.extend(blocks)
                for child in module.children():  # a child outside the stack's class
                    if not any(child is block for block in blocks):
                        visit(child)
                return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _blocks_of(stack: nn.Module) -> list[nn.Module]:
    """The children of ``stack`` whose class at least two composite children share."""
    by_class: dict[type[nn.Module], list[nn.Module]] = {}
    for child in stack.children():
        if any(True for _ in child.children()) and any(True for _ in child.parameters()):
            by_class.setdefault(type(child), []).append(child)
    return [block for blocks in by_class.values() if len(blocks) > 1 for block in blocks]


class BlockCompiler:
    """A :data:`~distkit.runtime._compile.Compiler` that compiles the repeated blocks of
    what it is given, in place, with ``torch.compile``'s ``options``, and hands the module
    itself back (its blocks compiled): the strategy's ``compile_model`` order still applies
    (a backend that refuses compile= refuses this too)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.compiled: list[nn.Module] = []  # the blocks compiled, to restore at close

    def __call__(self, model: nn.Module) -> nn.Module:
        if isinstance(model, nn.DataParallel) and len(model.device_ids) > 1:
            # a replica is a copy of each module's attributes, the compiled call among them:
            # bound to the original block, it would run the original's weights on every GPU
            raise UnsupportedFeatureError(
                f'compile="blocks" with nn.DataParallel over {len(model.device_ids)} GPUs: '
                "its replicas copy each block's compiled call, which belongs to the original "
                "block. Use strategy='ddp' (one process per GPU), or compile=True"
            )
        blocks = repeated_blocks(model)
        if not blocks:
            raise ConfigurationError(
                f'compile="blocks" found no repeated block in {type(model).__name__}: no '
                "nn.ModuleList or nn.Sequential holds two or more modules of one class that "
                f"have submodules of their own (its classes: {_classes(model)}). Use "
                "compile=True to compile the whole model"
            )
        for block in blocks:
            if getattr(block, "_compiled_call_impl", None) is None:
                block.compile(**self.options)
                self.compiled.append(block)
        return model

    def release(self) -> None:
        """Give every block this compiler compiled its plain call back."""
        for block in self.compiled:
            block._compiled_call_impl = None
        self.compiled.clear()

    def __repr__(self) -> str:
        return f"BlockCompiler({self.options!r})"


def _classes(model: nn.Module) -> str:
    names = sorted({type(m).__name__ for m in model.modules()})
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
