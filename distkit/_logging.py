"""What the trainer reports between steps: lazy step logs, rank-0 loggers, log points.

Nothing here synchronises the host with the device per step: a step's values stay device
tensors in :class:`StepLogs` until somebody reads them, and the loggers' values are gathered
over ranks once every ``log_every_n_steps`` steps (:class:`LogWindow`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from distkit._checks import check_instance
from distkit.errors import ConfigurationError
from distkit.loggers import Logger
from distkit.loggers._base import as_number, as_numbers
from distkit.strategies.base import Strategy


class StepLogs(Mapping[str, Any]):
    """One optimizer step's values; a device tensor becomes a float when first read.

    A value may also be a ``functools.partial`` that computes it (a tensor, then read):
    called on first read only, so that the steps whose logs nobody reads cost nothing.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if isinstance(value, functools.partial):
            value = value()
        if isinstance(value, torch.Tensor):
            value = value.item()
        self._values[key] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"StepLogs({dict(self)!r})"


class LogSink:
    """The loggers, written on rank 0 only; values logged for one step go into one row."""

    def __init__(self, loggers: Iterable[Logger] | None, *, is_main: bool) -> None:
        self.loggers = checked_loggers(loggers)
        self.is_main = is_main
        self._step: int | None = None
        self._row: dict[str, int | float] = {}

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Add ``metrics`` to the row of ``step`` (written by :meth:`flush`).

        Checked on every rank (a bad value fails everywhere, not only on rank 0), read
        (tensors: a host synchronisation) only on rank 0.
        """
        if not (self.is_main and self.loggers):
            for key, value in metrics.items():
                if not (isinstance(value, torch.Tensor) and value.dim() == 0):
                    as_number(key, value)  # raises for what is not a number
            return
        numbers = as_numbers(metrics)
        if self._step is not None and step != self._step:
            self.flush()
        self._step = step
        self._row.update(numbers)

    def flush(self) -> None:
        """Write the pending row to every logger."""
        if self._step is not None and self._row:
            for logger in self.loggers:
                logger.log_metrics(dict(self._row), self._step)
        self._step, self._row = None, {}

    def hyperparams(self, params: Mapping[str, Any]) -> None:
        if self.is_main:
            for logger in self.loggers:
                logger.log_hyperparams(dict(params))

    def finalize(self, status: str) -> None:
        """Flush and close every logger (rank 0); the other ranks have nothing to close."""
        if not self.is_main:
            return
        try:
            self.flush()
        finally:
            for logger in self.loggers:
                logger.finalize(status)


class LogWindow:
    """The samples since the last log point (their losses are the ledger's); gathered there."""

    def __init__(self, strategy: Strategy, every: int) -> None:
        self.strategy = strategy
        self.every = every
        self._samples = 0

    def add(self, samples: int) -> None:
        self._samples += samples

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def gather(self, loss_sum: torch.Tensor, *, stop: bool) -> tuple[float, bool]:
        """(mean training loss over every rank's samples since the last log point, whether
        any rank wants to stop): one all-reduce and one host synchronisation.

        ``loss_sum`` is this rank's loss x samples over the window (a device scalar).
        """
        device = self.strategy.device
        packed = torch.stack([
            loss_sum.to(device, torch.float64),
            torch.tensor(float(self._samples), dtype=torch.float64, device=device),
            torch.tensor(float(stop), dtype=torch.float64, device=device),
        ])  # fmt: skip
        total, samples, stops = self.strategy.all_reduce(packed, op="sum").tolist()
        self._samples = 0
        return (total / samples if samples else float("nan")), stops > 0


def checked_loggers(loggers: Iterable[Logger] | None) -> list[Logger]:
    """``Trainer(loggers=...)`` as a list of Logger instances, or a ConfigurationError."""
    if loggers is None:
        return []
    if isinstance(loggers, Logger) or not isinstance(loggers, Iterable):
        raise ConfigurationError(
            f"loggers must be a list of distkit.loggers.Logger instances, got "
            f"{type(loggers).__name__}; wrap one in a list: loggers=[CSVLogger('logs')]"
        )
    checked = list(loggers)
    for i, logger in enumerate(checked):
        check_instance(
            logger, Logger, where=f"loggers[{i}]", name="distkit.loggers.Logger",
            fix="subclass Logger and implement log_metrics(metrics, step)",
        )  # fmt: skip
    return checked
