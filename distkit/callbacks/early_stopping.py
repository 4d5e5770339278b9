"""EarlyStopping: stop when a monitored metric stops improving."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from distkit._validate import check_ints
from distkit.callbacks._base import Callback
from distkit.callbacks._monitor import Monitor
from distkit.errors import ConfigurationError

if TYPE_CHECKING:
    from distkit.trainer import FitResult, Trainer


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks.

    A check happens after each validation that reports ``monitor`` (``val_loss``,
    ``val_acc``...: every ``val_every_n_steps`` steps and at each epoch's end), or at each
    epoch's end for an epoch-record key such as ``train_loss``. Validation results are the
    same on every rank, so every rank decides alike; the trainer stops them all after the
    same step. The counter and best value go into checkpoints: a resumed run goes on
    counting. A ``monitor`` that is never reported raises at the first validation (a
    ``val_...`` name) or epoch end that lacks it; a fit that trained and ended before
    either warns (see :class:`~distkit.callbacks._monitor.Monitor`).

    Args:
        monitor: the metric's name.
        patience: checks without improvement before stopping (>= 1).
        mode: ``"min"`` (lower is better) or ``"max"``.
        min_delta: an improvement must beat the best value by more than this.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 3,
        mode: str = "min",
        min_delta: float = 0.0,
    ) -> None:
        self._monitor = Monitor("EarlyStopping", monitor, mode)
        self.monitor, self.mode = self._monitor.monitor, self._monitor.mode
        check_ints(patience=(patience, 1))
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ConfigurationError(
                f"EarlyStopping(min_delta={min_delta!r}): a number >= 0 (how much better a "
                "value must be to count as an improvement)"
            )
        self.patience = patience
        self.min_delta = float(min_delta)
        self.best: float | None = None
        self.wait = 0  # checks since the last improvement
        self.stopped_step: int | None = None

    @override
    @property
    def state_key(self) -> str:
        return self._monitor.key

    @override
    def on_fit_start(self, trainer: Trainer) -> None:
        self._monitor.start(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        value = self._monitor.at_validation(trainer, metrics)
        if value is not None:
            self._check(trainer, value)

    @override
    def on_epoch_end(self, trainer: Trainer, record: Mapping[str, float]) -> None:
        value = self._monitor.at_epoch_end(trainer, record)
        if value is not None:
            self._check(trainer, value)

    @override
    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        self._monitor.at_fit_end(trainer)

    def _check(self, trainer: Trainer, value: float) -> None:
        if self._monitor.better(value, self.best, self.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_step = trainer.global_step
            trainer.should_stop = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_step": self.stopped_step}

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.wait = int(state.get("wait", 0))
        stopped = state.get("stopped_step")
        self.stopped_step = None if stopped is None else int(stopped)

    @override
    def __repr__(self) -> str:
        return (
            f"EarlyStopping(monitor={self.monitor!r}, patience={self.patience}, "
            f"mode={self.mode!r}, min_delta={self.min_delta})"
        )
