"""Each model and optimizer is set up once per trainer.

Set-up hooks into parameters (DDP's reducer, Horovod's allreduce hooks): wrapping a model a
second time would register them twice.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from distkit.errors import ConfigurationError
from distkit.runtime._checkpointing import Policy, apply_checkpointing, remove_checkpointing
from distkit.runtime._compile import Compiler
from distkit.runtime._compile_blocks import BlockCompiler
from distkit.strategies._placement import Placement, place, state_follows_parameters
from distkit.strategies.base import Strategy
from distkit.strategies.precision import check_model_dtype

#: the open set-up of each module, process-wide: one module is set up by one Runtime at a
#: time (two would hook its parameters twice: DDP's and Horovod's hooks cannot be removed)
_OWNER: weakref.WeakKeyDictionary[nn.Module, weakref.ref[SetupCache]] = weakref.WeakKeyDictionary()


def _claim(model: nn.Module, cache: SetupCache) -> None:
    """Refuse ``model`` if another open Runtime set it up (after collecting: a Trainer that
    was dropped without close() is no owner), else record ``cache`` as its owner."""
    owner = _OWNER.get(model)
    other = owner() if owner is not None else None
    if other is not None and other is not cache and not other.closed:
        gc.collect()  # a dropped Runtime's finalizer closes it
        other = owner() if owner is not None else None
    if other is not None and other is not cache and not other.closed:
        raise ConfigurationError(
            f"this {type(model).__name__} is set up by another Runtime (or Trainer) that is "
            "still open: its backend's hooks are on the model's parameters, and a second "
            "set-up would add its own (gradients averaged twice, or not at all). Close the "
            "first (rt.close(), trainer.close(), or leave its with-block) before setting the "
            "model up again, or keep using the first"
        )
    _OWNER[model] = weakref.ref(cache)


class SetupCache:
    """Models and optimizers as the strategy set them up, held weakly."""

    def __init__(self, strategy: Strategy, checkpointing: Policy | None = None) -> None:
        self.strategy = strategy
        #: the modules whose activations are recomputed in backward (None: none)
        self.checkpointing = checkpointing
        self._models: weakref.WeakKeyDictionary[nn.Module, nn.Module]
        self._models = weakref.WeakKeyDictionary()
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.optim.Optimizer]
        self._optimizers = weakref.WeakKeyDictionary()
        self._compiled: weakref.WeakKeyDictionary[nn.Module, nn.Module]
        self._compiled = weakref.WeakKeyDictionary()
        self._block_compilers: list[BlockCompiler] = []  # compile="blocks": released at close
        # where each model was when it was set up: after set-up a strategy may have moved
        # parts of it (FSDP's CPU offload keeps parameters on the CPU, buffers on the GPU)
        self._placements: weakref.WeakKeyDictionary[nn.Module, Placement]
        self._placements = weakref.WeakKeyDictionary()
        #: whether shutdown ran: what this cache set up runs no more (see LoopState.ready)
        self.closed = False
        #: the user's modules whose forward this set-up checkpointed (given back at shutdown)
        self._checkpointed: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, placement: Placement
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The wrapped model and the strategy's optimizer, setting them up on first use;
        ``placement``: where the model is before (the fit found it while preparing)."""
        wrapped = self._models.get(model)
        if wrapped is None:
            _claim(model, self)
            check_model_dtype(self.strategy.options.precision, model)
            self._placements[model] = placement
            self._checkpoint(model)
            wrapped, strategy_optimizer = self.strategy.setup(model, optimizer)
            self._models[model] = wrapped
            self._optimizers[optimizer] = strategy_optimizer
            _follow(optimizer, strategy_optimizer)
        elif optimizer not in self._optimizers:
            self._optimizers[optimizer] = self.strategy.setup_optimizer(wrapped, optimizer)
            _follow(optimizer, self._optimizers[optimizer])
        return wrapped, self._optimizers[optimizer]

    def setup_together(
        self, entries: list[tuple[nn.Module, list[torch.optim.Optimizer], Placement]]
    ) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        """Set several models (each with its optimizers) up in one strategy call, for a
        backend that sets up everything at once (legacy apex's ``amp.initialize``)."""
        for model, _, _ in entries:
            _claim(model, self)
            check_model_dtype(self.strategy.options.precision, model)
        for model, _, _ in entries:
            self._checkpoint(model)
        done = self.strategy.setup_together([(model, opts) for model, opts, _ in entries])
        for (model, opts, placement), (wrapped, inners) in zip(entries, done, strict=True):
            self._placements[model] = placement
            self._models[model] = wrapped
            for opt, inner in zip(opts, inners, strict=True):
                self._optimizers[opt] = inner
                _follow(opt, inner)
        return done

    def _checkpoint(self, model: nn.Module) -> None:
        """Activation checkpointing, before the strategy wraps the model (see _checkpointing)."""
        if self.checkpointing is not None:
            self._checkpointed.update(apply_checkpointing(model, self.checkpointing))

    def placement(self, model: nn.Module) -> Placement:
        """Where ``model`` was when it was set up, or where it is now if it was not."""
        known = self._placements.get(model)
        return known if known is not None else Placement.of(model, self.strategy.device)

    def compiled(self, model: nn.Module, compiler: Compiler | None) -> nn.Module | None:
        """The set-up model compiled by the strategy (once per model), or None when off."""
        if compiler is None:
            return None
        compiled = self._compiled.get(model)
        if compiled is None:
            compiled = self._compiled[model] = self.strategy.compile_model(
                self._models[model], compiler
            )
            if isinstance(compiler, BlockCompiler):  # in place: undone at close
                self._block_compilers.append(compiler)
        return compiled

    def shutdown(self) -> None:
        """Drop the wrappers, collect them, then tear the strategy down (in that order).

        A DDP wrapper collected after its gloo process group is destroyed (typically during
        interpreter shutdown) aborts the process with "terminate called without an active
        exception"; collecting it first avoids that.
        """
        self.closed = True
        remove_checkpointing(list(self._checkpointed))
        for compiler in self._block_compilers:
            compiler.release()
        self._block_compilers.clear()
        self._models.clear()
        self._optimizers.clear()
        self._compiled.clear()
        gc.collect()
        self.strategy.teardown()

    def wrapped(self, model: nn.Module) -> nn.Module:
        """The wrapped model if it was set up, else the model moved to the strategy's device
        (unless the user placed it and the strategy keeps that: see _placement)."""
        wrapped = self._models.get(model)
        if wrapped is None:
            strategy = self.strategy
            place(
                model,
                strategy.device,
                strategy.name,
                strategy.placement_refusal,
                choices=strategy.choices,
            )
            return model
        return wrapped


def _follow(*optimizers: torch.optim.Optimizer) -> None:
    """State loaded before the set-up (a resumed fit's checkpoint) onto the devices the
    set-up moved the parameters to; the user's optimizer and the strategy's (a wrapper, or
    a replacement with its own state)."""
    for optimizer in {id(opt): opt for opt in optimizers}.values():
        state_follows_parameters(optimizer)
