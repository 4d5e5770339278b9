"""What the trainer reports between steps: lazy step logs, rank-0 loggers, log points.

Nothing here synchronises the host with the device per step: a step's values stay device
tensors in :class:`StepLogs` until somebody reads them, and the loggers' values are gathered
over ranks once every ``log_every_n_steps`` steps (:class:`LogWindow`). Loggers run on rank 0
only and are best-effort: one that raises is reported and retried, then disabled (:class:`LogSink`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from typing_extensions import override

from distkit._validate import check_instance
from distkit.errors import ConfigurationError
from distkit.loggers import Logger
from distkit.loggers._base import as_number, as_numbers
from distkit.runtime import tagged_sum
from distkit.strategies.base import Strategy
from distkit.trainer._losses import LossLedger
from distkit.trainer._nonfinite import NonFiniteWatch


class StepLogs(Mapping[str, Any]):
    """One optimizer step's values; a device tensor becomes a float when first read.

    A value may also be a ``functools.partial`` that computes it (a tensor, then read):
    called on first read only, so that the steps whose logs nobody reads cost nothing.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values

    @override
    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if isinstance(value, functools.partial):
            value = value()
        if isinstance(value, torch.Tensor):
            value = value.item()
        self._values[key] = value
        return value

    @override
    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    @override
    def __len__(self) -> int:
        return len(self._values)

    @override
    def __repr__(self) -> str:
        return f"StepLogs({dict(self)!r})"


MAX_FAILURES = 10
"""A logger that fails this many calls in a row is not called again in this fit."""


@dataclass
class _Health:
    """How one logger has fared in this fit (rank 0)."""

    failures: int = 0  # in a row; a call that works resets it
    disabled: bool = False
    reported: set[type[BaseException]] = field(default_factory=set)  # kinds already warned of


class LogSink:
    """The loggers, written on rank 0 only; values logged for one step go into one row.

    A logger is best-effort: what it raises (an ``Exception``) is reported, not raised, unless
    it is ``strict``, and never while the fit ends with a failure (:meth:`finalize`); see
    :class:`~distkit.loggers.Logger`. Only rank 0 calls loggers, so their failures change
    nothing the ranks must agree on.
    """

    def __init__(self, loggers: Iterable[Logger] | None, *, is_main: bool) -> None:
        self.loggers = checked_loggers(loggers)
        self.is_main = is_main
        self._step: int | None = None
        self._row: dict[str, int | float] = {}
        self._health = [_Health() for _ in self.loggers]

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
        if self._step is None:  # nothing pending (most steps: called after each)
            return
        _raise_first([self._write_row(failing=False)])

    def hyperparams(self, params: Mapping[str, Any]) -> None:
        if self.is_main:
            error = self._each("log_hyperparams", lambda lg: lg.log_hyperparams(dict(params)))
            _raise_first([error])

    def finalize(self, status: str) -> None:
        """Flush and close every logger (rank 0); the other ranks have nothing to close.

        A disabled logger is finalized too (so it can close its files or end its run). With
        a status other than ``"success"`` the fit is already failing: a logger's exception is
        reported and suppressed, a strict logger's too, so the fit's own error propagates.
        """
        if not self.is_main:
            return
        failing = status != "success"
        errors: list[Exception | None] = []
        try:
            errors.append(self._write_row(failing=failing))
        finally:
            call, close = f"finalize({status!r})", lambda lg: lg.finalize(status)
            errors.append(self._each(call, close, failing=failing, disabled_too=True))
        _raise_first(errors)

    def _write_row(self, *, failing: bool) -> Exception | None:
        step, row = self._step, self._row
        self._step, self._row = None, {}  # taken even if a logger fails: never written twice
        if step is None or not row:
            return None
        call = f"log_metrics at step {step}"
        return self._each(call, lambda lg: lg.log_metrics(dict(row), step), failing=failing)

    def _each(
        self,
        call: str,
        fn: Callable[[Logger], object],
        *,
        failing: bool = False,
        disabled_too: bool = False,
    ) -> Exception | None:
        """``fn(logger)`` for every logger still enabled; returns the first strict logger's
        exception (None while ``failing``) after every logger had its call."""
        first: Exception | None = None
        for index, (logger, health) in enumerate(zip(self.loggers, self._health, strict=True)):
            if health.disabled and not disabled_too:
                continue
            try:
                fn(logger)
            except Exception as exc:
                if logger.strict and not failing:
                    first = first or exc
                else:
                    self._failed(index, call, exc, failing=failing)
            else:
                health.failures = 0
        return first

    def _failed(self, index: int, call: str, exc: Exception, *, failing: bool) -> None:
        """Count and report one failed call: once per kind of error, and when disabling."""
        logger, health = self.loggers[index], self._health[index]
        name, error = f"loggers[{index}] ({type(logger).__name__})", f"{type(exc).__name__}: {exc}"
        closing = call.startswith("finalize")
        health.failures += 1
        messages = []
        if type(exc) not in health.reported:
            health.reported.add(type(exc))
            if failing:
                then = "not raised: the fit's own error is the one that propagates"
            elif closing:
                then = "the fit's result stands"
            else:
                then = (
                    f"training goes on; distkit calls it again at the next log point and stops "
                    f"calling it after {MAX_FAILURES} failures in a row (what this call carried "
                    "is not sent again)"
                )
            hint = "" if logger.strict else _STRICT_HINT
            messages.append(f"{name} failed in {call}: {error}; {then}. {_ONCE}{hint}")
        if not (closing or health.disabled) and health.failures >= MAX_FAILURES:
            health.disabled = True
            messages.append(
                f"{name} failed {health.failures} times in a row (the last in {call}: {error}); "
                "distkit stops calling it for the rest of this fit (it still gets finalize at "
                f"the end). Fix the logger or its service.{_STRICT_HINT}"
            )
        for message in messages:
            try:
                warnings.warn(message, stacklevel=2)
            except Exception:  # warnings made errors (python -W error)
                if not failing:  # while failing, the fit's own error must propagate
                    raise


_ONCE = "(Reported once per kind of error.)"
_STRICT_HINT = (
    " To end the fit on this logger's errors instead, set strict=True on it "
    "(Logger(strict=True), or logger.strict = True)."
)


class LogWindow:
    """The samples since the last log point (their losses are the ledger's); gathered there."""

    def __init__(self, strategy: Strategy, every: int) -> None:
        self.strategy = strategy
        self.every = every
        self._samples: int | torch.Tensor = 0  # or a token-exact loss's items

    def add(self, samples: int | torch.Tensor) -> None:
        self._samples = self._samples + samples

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def gather(
        self, ledger: LossLedger, watch: NonFiniteWatch, now: int, *, stop: bool
    ) -> tuple[float, float, bool]:
        """(mean training loss over every rank's samples since the last log point, those
        samples summed over ranks (a token-exact loss's items), whether any rank wants to
        stop), with ``watch``'s non-finite check (``nonfinite="raise"``)
        riding in the same sum: one host read (:meth:`LossLedger.read_window`) and one
        all-reduce (none on one rank). ``now`` is the global step.

        Raises:
            NonFiniteLossError: on every rank, when a rank noted a non-finite loss.
        """
        size, rank = self.strategy.world_size, self.strategy.rank
        total, samples, found = ledger.read_window(self._samples)
        self._samples = 0
        if not self.strategy.data_leader:  # its tensor-parallel group's first counts them
            total, samples = 0.0, 0
        check = watch.payload(found, size, rank) if watch.due(now) else []
        # a host-side sum, tagged (see _call_tags)
        summed = tagged_sum(self.strategy, "log", [total, samples, float(stop), *check])
        if check:
            watch.verdict(summed[3:], now)
        total, samples, stops = summed[:3]
        return (total / samples if samples else float("nan")), samples, stops > 0


def _raise_first(errors: list[Exception | None]) -> None:
    for error in errors:
        if error is not None:
            raise error


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
            logger,
            Logger,
            where=f"loggers[{i}]",
            name="distkit.loggers.Logger",
            fix="subclass Logger and implement log_metrics(metrics, step)",
        )
        strict = logger.strict  # a class or instance attribute: __init__ may not have run
        if not isinstance(strict, bool):
            raise ConfigurationError(
                f"loggers[{i}] ({type(logger).__name__}) has strict={strict!r} "
                f"({type(strict).__name__}); it must be True (its errors end the fit) or False "
                "(they are reported and training goes on): set logger.strict = True or False"
            )
    return checked
