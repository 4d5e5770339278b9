"""A monitored metric: where a callback reads it, and whether a value improves on another."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from distkit.errors import ConfigurationError

if TYPE_CHECKING:
    from distkit.trainer import Trainer

MODES = ("min", "max")


class Monitor:
    """The metric ``monitor`` of callback ``owner``, better when lower (``mode="min"``) or
    higher (``"max"``).

    It is read after each validation that reports it (``val_loss``, ``val_acc``...) or, for
    an epoch-record key (``train_loss``), at each epoch's end, once per step: an epoch-end
    validation is not read a second time from the epoch's record.
    """

    def __init__(self, owner: str, monitor: object, mode: object) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ConfigurationError(
                f"{owner}(monitor={monitor!r}): monitor is the name of a metric, e.g. "
                "'val_loss' or 'val_acc' (a key of the validation results or epoch records)"
            )
        if mode not in MODES:
            raise ConfigurationError(
                f"{owner}(mode={mode!r}): allowed 'min' (lower is better, e.g. a loss) or "
                "'max' (higher is better, e.g. accuracy)"
            )
        self.owner = owner
        self.monitor = monitor
        self.mode = str(mode)
        self._read_at: int | None = None  # the global step of the last value read
        self._seen: list[str] = []  # the names reported so far, for the error message

    @property
    def key(self) -> str:
        """A state key that tells two monitoring callbacks of one kind apart."""
        return f"{self.owner}[{self.monitor},{self.mode}]"

    def at_validation(self, trainer: Trainer, metrics: Mapping[str, float]) -> float | None:
        """The monitored value in a validation's results, if they hold it."""
        self._seen += list(metrics)
        value = metrics.get(self.monitor)
        if value is None:
            return None
        self._read_at = trainer.global_step
        return float(value)

    def at_epoch_end(self, trainer: Trainer, record: Mapping[str, float]) -> float | None:
        """The monitored value in an epoch's record, unless it was read at this step.

        Raises:
            ConfigurationError: neither the validations nor the record hold it.
        """
        self._seen += list(record)
        if self._read_at == trainer.global_step:
            return None  # the epoch-end validation was read already
        value = record.get(self.monitor)
        if value is None:
            raise ConfigurationError(
                f"{self.owner} monitors {self.monitor!r}, which no validation or epoch "
                f"reported; they reported: {', '.join(sorted(set(self._seen))) or 'nothing'}. "
                "Pass val_data (and metrics) to fit, or monitor one of these names"
            )
        self._read_at = trainer.global_step
        return float(value)

    def better(self, value: float, best: float | None, min_delta: float = 0.0) -> bool:
        """Whether ``value`` improves on ``best`` by more than ``min_delta`` (NaN never does)."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        return value < best - min_delta if self.mode == "min" else value > best + min_delta
