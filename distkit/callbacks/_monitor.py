"""A monitored metric: where a callback reads it, and whether a value improves on another."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from distkit.errors import ConfigurationError

if TYPE_CHECKING:
    from distkit.trainer import Trainer

MODES = ("min", "max")
#: every validation result is named ``val_<name>``; no other record's name starts so
VALIDATION_PREFIX = "val_"


class Monitor:
    """The metric ``monitor`` of callback ``owner``, better when lower (``mode="min"``) or
    higher (``"max"``).

    It is read after each validation that reports it (``val_loss``, ``val_acc``...) or, for
    an epoch-record key (``train_loss``), at each epoch's end, once per step: an epoch-end
    validation is not read a second time from the epoch's record.

    A name that cannot be read is reported as soon as that is certain: a ``val_`` name that
    the first validation lacks, or any name that the first epoch's record lacks, raises (on
    every rank alike: validations and records are the same on every rank). A fit that ends
    before either (a stream with ``max_steps``) may never have produced the name, so
    :meth:`at_fit_end` warns instead of raising.
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
        self._read_at: int | None = None  # the global step of the last value read this fit
        self._seen: dict[str, None] = {}  # the names reported this fit, for the messages
        self._started_at: int | None = None  # the global step the fit started at

    def start(self, trainer: Trainer) -> None:
        """A new fit (or a resumed one) begins: nothing reported or read in it yet."""
        self._read_at, self._seen = None, {}
        self._started_at = trainer.global_step

    @property
    def key(self) -> str:
        """A state key that tells two monitoring callbacks of one kind apart."""
        return f"{self.owner}[{self.monitor},{self.mode}]"

    def at_validation(self, trainer: Trainer, metrics: Mapping[str, float]) -> float | None:
        """The monitored value in a validation's results, if they hold it.

        Raises:
            ConfigurationError: a validation name (``val_...``) that the results lack.
        """
        self._seen.update(dict.fromkeys(metrics))
        value = metrics.get(self.monitor)
        if value is None:
            if self.monitor.startswith(VALIDATION_PREFIX):  # only validations report these
                raise ConfigurationError(
                    f"{self.owner} monitors {self.monitor!r}, which the validation at step "
                    f"{trainer.global_step} did not report; it reported: {_names(metrics)}. "
                    "Monitor one of these: a validation reports 'val_loss' (with a loss_fn) "
                    "and 'val_<name>' for each of fit's metrics (metrics={'acc': Accuracy()} "
                    "gives 'val_acc')"
                )
            return None
        self._read_at = trainer.global_step
        return float(value)

    def at_epoch_end(self, trainer: Trainer, record: Mapping[str, float]) -> float | None:
        """The monitored value in an epoch's record, unless it was read at this step.

        Raises:
            ConfigurationError: neither the validations nor the record hold it.
        """
        self._seen.update(dict.fromkeys(record))
        if self._read_at == trainer.global_step:
            return None  # the epoch-end validation was read already
        value = record.get(self.monitor)
        if value is None:
            raise ConfigurationError(
                f"{self.owner} monitors {self.monitor!r}, which no validation or epoch "
                f"reported; they reported: {_names(self._seen)}. "
                "Pass val_data (and metrics) to fit, or monitor one of these names"
            )
        self._read_at = trainer.global_step
        return float(value)

    def at_fit_end(self, trainer: Trainer) -> None:
        """Warn (on rank 0) when the fit trained and ended without the monitored value ever
        being read (a fit with nothing left to train, e.g. a finished run resumed, is quiet)."""
        trained = trainer.global_step != self._started_at
        if self._read_at is not None or not trained or not trainer.is_main:
            return
        warnings.warn(
            f"{self.owner} monitors {self.monitor!r}, which was never reported: fit ended at "
            f"step {trainer.global_step} without {self.owner} acting once. Reported: "
            f"{_names(self._seen)} (an epoch record's names such as 'train_loss' come only at "
            "an epoch's end, which a stream with max_steps may never reach). Check the name, "
            "or validate within the run: fit(val_data=...) with "
            "Trainer(val_every_n_steps=...) for a 'val_...' name",
            stacklevel=2,
        )

    def better(self, value: float, best: float | None, min_delta: float = 0.0) -> bool:
        """Whether ``value`` improves on ``best`` by more than ``min_delta`` (NaN never does)."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        return value < best - min_delta if self.mode == "min" else value > best + min_delta


def _names(names: Iterable[str]) -> str:
    return ", ".join(sorted(set(names))) or "nothing"
