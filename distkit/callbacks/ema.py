"""EMA: an exponential moving average of the weights, validated and checkpointed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn
from typing_extensions import override

from distkit._validate import check_flags
from distkit.callbacks import _averages
from distkit.callbacks._base import Callback
from distkit.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from distkit.trainer import FitResult, Trainer


class EMA(Callback):
    """Keep an exponential moving average of the model's parameters while ``fit`` trains.

    After every optimizer step that stepped (a step skipped for non-finite gradients or an
    fp16 overflow changes nothing), each average moves towards its parameter:
    ``average = decay * average + (1 - decay) * parameter``, in float32 (float64 for a float64
    parameter), starting from the weights the fit starts with. Every validation runs on the
    averages (they are swapped in for it and the trained weights back afterwards);
    checkpoints hold them, so a resumed fit, at any world size and on any backend, goes on
    averaging exactly where it stopped. After ``fit`` the model holds the trained weights
    (``apply_at_end=True``: the averages); :meth:`averaged_state_dict` gives the averaged
    model to save or evaluate.

    Buffers are not averaged: BatchNorm's running statistics and the like stay the model's
    own during validation and in :meth:`averaged_state_dict`.

    The same on every backend: each rank keeps the averages of the parameters as it holds
    them (under fsdp, copies of its own shards), so a step costs no communication;
    a checkpoint gathers them to full tensors, keyed like the model's parameters.

    Args:
        decay: how much of the average each step keeps, a number in ``[0, 1)``; ``0``
            follows the weights exactly. Typical: ``0.999`` (about the last 1,000 steps).
        apply_at_end: leave the averages in the model when ``fit`` ends (default: the
            trained weights).
    """

    #: reads the step (its ``skipped``), never stops the fit: no stop check after each step
    stops_training = False

    def __init__(self, decay: float = 0.999, *, apply_at_end: bool = False) -> None:
        if (
            isinstance(decay, bool)
            or not isinstance(decay, (int, float))
            or not (0.0 <= float(decay) < 1.0)
            or math.isnan(decay)
        ):
            raise ConfigurationError(
                f"EMA(decay={decay!r}): decay must be a number in [0, 1), the share of the "
                "average each step keeps; typical: EMA(decay=0.999)"
            )
        check_flags(apply_at_end=apply_at_end)
        self.decay = float(decay)
        self.apply_at_end = apply_at_end
        #: optimizer steps averaged so far (resumed ones included)
        self.updates = 0
        self._module: nn.Module | None = None  # the model being trained, as the user gave it
        self._averages: _averages.Averages | None = None  # laid out as its parameters
        self._loaded: dict[str, torch.Tensor] | None = None  # full, from a checkpoint
        self._trained: dict[str, torch.Tensor] | None = None  # held while validating

    # ------------------------------------------------------------------ the fit's hooks
    @override
    def on_fit_start(self, trainer: Trainer) -> None:
        module = _user_model(trainer)
        if module is not self._module:
            self._module, self._averages = module, None
        self._current()  # a checkpoint's averages checked against the model now, not later

    @override
    def on_train_step_end(self, trainer: Trainer, logs: Mapping[str, Any]) -> None:
        if logs["skipped"]:
            return
        _averages.update_(self._current(), self._model(), self.decay)
        self.updates += 1

    @override
    def on_validation_start(self, trainer: Trainer) -> None:
        module = self._model()
        self._trained = _averages.trained_copy(module)
        _averages.copy_into(module, self._current())

    @override
    def on_validation_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        self._restore()

    @override
    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        if self.apply_at_end:
            _averages.copy_into(self._model(), self._current())

    @override
    def on_exception(self, trainer: Trainer, exc: BaseException) -> None:
        self._restore()  # a validation that failed half-way: the trained weights back

    # ------------------------------------------------------------------ the averages
    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged model: ``model.state_dict()``'s keys, full CPU tensors, the averages
        in place of the parameters (in their dtype) and the model's own buffers.

        Load it into a copy of the model to save or evaluate it. Under fsdp a collective
        (the shards are gathered): call it on every rank.
        """
        module = self._model()
        full = _averages.full_averages(self._current(), module)
        # a tied parameter is one average under its first name, and every name's entry
        named = dict(module.named_parameters())
        first = {id(p): name for name, p in reversed(named.items())}
        aliases = {
            name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False)
        }
        out = {}
        for key, value in module.state_dict().items():
            if key in aliases:
                out[key] = full[aliases[key]].to(value.dtype)
            else:  # a buffer (a DTensor where the backend shards it, as a parameter)
                out[key] = _whole(value)
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        """The averages as full tensors (gathered under fsdp: every rank calls this at the
        same point of a save) and the number of steps averaged."""
        if self._loaded is not None:
            averages = dict(self._loaded)  # not yet laid out for a model: as loaded
        elif self._averages is None or self._module is None:
            averages = None
        else:
            averages = _averages.full_averages(self._averages, self._module)
        return {"decay": self.decay, "updates": self.updates, "averages": averages}

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take saved averages; they are laid out for the model at their next use."""
        self.updates = int(state.get("updates", 0))
        averages = state.get("averages")
        self._loaded = None if averages is None else dict(averages)
        if averages is not None:
            self._averages = None

    def _current(self) -> _averages.Averages:
        """This rank's averages, a checkpoint's laid out for the model first."""
        module = self._model()
        if self._loaded is not None:
            self._averages = _averages.local_averages(
                self._loaded, module, what="the checkpoint's EMA averages"
            )
            self._loaded = None
        if self._averages is None:
            self._averages = _averages.averages_of(module)
        return self._averages

    def _model(self) -> nn.Module:
        if self._module is None:
            raise ConfigurationError(
                "EMA has no model yet: its averages exist once a fit with "
                "Trainer(callbacks=[EMA(...)]) has started"
            )
        return self._module

    def _restore(self) -> None:
        if self._trained is not None and self._module is not None:
            _averages.copy_into(self._module, self._trained)
            self._trained = None


def _user_model(trainer: Trainer) -> nn.Module:
    model = trainer.model  # the fit's model as the user passed it (no backend's wrapper)
    assert model is not None, "on_fit_start runs inside a fit"
    return model


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A state entry as a full CPU tensor (a DTensor's shards gathered: a collective)."""
    full_tensor = getattr(value, "full_tensor", None)
    whole = value if full_tensor is None else full_tensor()
    return whole.detach().to("cpu", copy=True)
