"""The Callback base: user code that runs between the steps of ``Trainer.fit``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from distkit.trainer import FitResult, Trainer


class Callback:
    """Hooks that :meth:`distkit.Trainer.fit` calls on **every rank**, in this order.

    ``on_fit_start`` -> per optimizer step ``on_before_optimizer_step`` (on the step's final
    gradients) and ``on_train_step_end`` (and around each validation,
    every ``val_every_n_steps`` and at each epoch's end, ``on_validation_start`` and
    ``on_validation_end``) -> per epoch ``on_epoch_end`` -> ``on_fit_end``; ``on_exception``
    instead when ``fit`` raises.
    Every method does nothing by default: override the ones you need.

    ``trainer.should_stop = True`` (from any rank's callback) stops every rank after the
    same step. ``state_dict`` / ``load_state_dict`` carry a callback's own state through
    checkpoints (plain tensors, ``int``, ``float``, ``bool``, ``str``, ``None``, lists, tuples
    and dicts, of exactly these types: checkpoints load weights-only, so ``np.float64`` or
    an ``IntEnum`` is refused at save time with the conversion to store instead).
    """

    #: whether ``on_train_step_end`` may set ``trainer.should_stop``. When a callback that
    #: overrides ``on_train_step_end`` says so (the default), every step ends with one tiny
    #: all-reduce so that every rank stops after the same step; set it to False in a callback
    #: that only reads the step (a monitor, a printer) to save that.
    stops_training: ClassVar[bool] = True

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint (unique among the callbacks)."""
        return type(self).__qualname__

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step of ``fit`` (after a resume's state is loaded)."""

    def on_before_optimizer_step(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        """Once per optimizer step, at the end of its accumulation window, before clipping and
        the step: the gradients (``p.grad`` of ``optimizer``'s parameters) are final, averaged
        over ranks and unscaled (fp16), the same on every backend, so you may read, log or
        change them in place (a gradient norm, your own clipping). ``optimizer`` is the one
        you passed to ``fit``; under fsdp each gradient is a DTensor holding this rank's
        shard (``.full_tensor()`` gathers it: a collective, call it on every rank).

        Overriding it costs each step an early finalization of the gradients (fp16: the
        unscale that clipping does too); fits without such a callback do not pay it.
        """

    def on_train_step_end(self, trainer: Trainer, logs: Mapping[str, Any]) -> None:
        """After each optimizer step.

        ``logs`` holds ``"step"`` (the 1-based global optimizer step), ``"epoch"``,
        ``"loss"`` (this rank's mean training loss over the step's samples), ``"lr"`` (the
        first parameter group's), ``"skipped"`` (the step was skipped: non-finite gradients
        or an fp16 overflow) and, with clipping, ``"grad_norm"`` (the total norm of the
        averaged gradients before clipping). Values on the device are read (a host
        synchronisation) only when you read them.
        """

    def on_validation_start(self, trainer: Trainer) -> None:
        """Before each validation (the model still holds the weights just trained: swap
        in others here, an EMA's for example, and back in ``on_validation_end``)."""

    def on_validation_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        """After each validation: ``{"val_loss": ..., "val_<metric>": ...}``, the same on
        every rank."""

    def on_epoch_end(self, trainer: Trainer, record: Mapping[str, float]) -> None:
        """After each epoch, with its history record (the same on every rank)."""

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        """After ``fit`` finished (or stopped early) without an error."""

    def on_exception(self, trainer: Trainer, exc: BaseException) -> None:
        """When ``fit`` raises ``exc`` on this rank (the error ``fit`` then raises: this
        rank's own, :class:`~distkit.PeerFailureError` or a
        :class:`~distkit.errors.TrainingInterrupted`). An error raised here is reported
        and does not replace ``exc``."""

    def state_dict(self) -> dict[str, Any]:
        """This callback's state, saved in every checkpoint (default: none).

        Called on every rank at the same point of each save, before the ranks agree on it
        (rank 0's goes into the file), so it may hold a collective that every rank meets
        (:class:`~distkit.callbacks.EMA` gathers fsdp's sharded averages here)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, when a fit resumes from a checkpoint."""
