"""CSVLogger: one ``metrics.csv`` row per ``log_metrics`` call, no dependencies."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, BinaryIO

from typing_extensions import override

from distkit._atomic import TempFile
from distkit.errors import ConfigurationError
from distkit.loggers._base import (
    Logger,
    as_numbers,
    check_no_file_in_the_way,
    check_save_dir,
    check_step,
)


class CSVLogger(Logger):
    """Writes ``<save_dir>/<filename>``: a ``step`` column, then one column per metric name.

    Columns appear in the order names are first logged. A name first seen after some rows were
    written widens the header: the whole file is rewritten (atomically: a temp file beside it,
    then ``os.replace``) and earlier rows get empty cells. Each row is flushed as it is written,
    so a crashed process loses at most the row being written.

    Resuming: when the file already exists at the first write (a resumed run logging into the
    same folder), the logger continues it. Rows whose step is >= the first step logged now are
    dropped, as is a half-written last row, so the steps a resumed run repeats appear once.

    Nothing is created until the first ``log_metrics``, so the logger can be built on every rank.

    Args:
        save_dir: the folder; created (with its parents) on the first write. A path with a
            regular file in the way (``"notes.txt/logs"``) is refused here, by looking only.
        filename: the file's name inside ``save_dir``.
        strict: True: an error writing the file ends the fit (see :class:`Logger`); False: it
            is reported and training goes on; None (default): the class attribute decides.

    Example:
        >>> logger = CSVLogger("runs/exp1")  # doctest: +SKIP
        >>> logger.log_metrics({"train_loss": 0.41, "lr": 0.1}, step=1)  # doctest: +SKIP
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        filename: str = "metrics.csv",
        *,
        strict: bool | None = None,
    ) -> None:
        super().__init__(strict=strict)
        self.save_dir = check_save_dir("CSVLogger", save_dir)
        if not isinstance(filename, str) or not filename or Path(filename).name != filename:
            raise ConfigurationError(
                f"CSVLogger(filename=...) must be a file name without folders, e.g. "
                f"'metrics.csv', got {filename!r}; put folders in save_dir"
            )
        self.path = self.save_dir / filename
        check_no_file_in_the_way(f"CSVLogger(save_dir={save_dir!r})", self.save_dir, "save_dir")
        if self.path.is_dir():
            raise ConfigurationError(
                f"CSVLogger(filename={filename!r}): {str(self.path)!r} is a folder, not a file; "
                "pass another filename or save_dir, or move the folder away"
            )
        self._columns: list[str] | None = None  # known once the file is opened
        self._file: IO[str] | None = None

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Write one row (``step`` and the values; missing names stay empty) and flush it."""
        step = check_step(step)
        values = as_numbers(metrics)
        if "step" in values:
            raise ConfigurationError(
                "metric name 'step' is the CSV's own first column; log it under another name"
            )
        if self._columns is None:
            self._start(step, values)
        elif any(key not in self._columns for key in values):
            self._rewrite(self._columns + _new_keys(self._columns, values), _read(self.path)[1])
        columns = self._columns
        assert columns is not None  # _start and _rewrite set it
        if self._file is None:  # the first row, or the first after a rewrite or finalize
            self._file = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115
        csv.writer(self._file, lineterminator="\n").writerow(
            [step, *(_cell(values.get(c)) for c in columns[1:])]
        )
        self._file.flush()

    @override
    def finalize(self, status: str) -> None:
        """Close the file (a later ``log_metrics`` reopens it)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _start(self, first_step: int, values: Mapping[str, object]) -> None:
        self.save_dir.mkdir(parents=True, exist_ok=True)
        columns, rows, complete = _read(self.path) if self.path.exists() else (["step"], [], False)
        kept = [row for row in rows if _step_of(row, self.path) < first_step]
        new = _new_keys(columns, values)
        if new or len(kept) < len(rows) or not complete:
            self._rewrite(columns + new, kept)
        else:
            self._columns = columns

    def _rewrite(self, columns: list[str], rows: list[list[str]]) -> None:
        """Replace the file with ``columns`` and ``rows`` (padded), then reopen it to append."""
        if self._file is not None:
            self._file.close()
            self._file = None

        def write(handle: BinaryIO) -> None:
            text = io.TextIOWrapper(handle, encoding="utf-8", newline="")
            writer = csv.writer(text, lineterminator="\n")
            writer.writerow(columns)
            writer.writerows(row + [""] * (len(columns) - len(row)) for row in rows)
            text.flush()
            text.detach()  # the temp file's owner closes the handle

        TempFile(self.path).publish(self.path, write)
        self._columns = columns


def _read(path: Path) -> tuple[list[str], list[list[str]], bool]:
    """The header, the rows and whether the file was complete (a cut-off last row is left out)."""
    text = path.read_text(encoding="utf-8")
    lines = list(csv.reader(io.StringIO(text, newline="")))
    if not lines:
        return ["step"], [], False
    if lines[0][:1] != ["step"]:
        raise ConfigurationError(
            f"{path} exists and is not a CSVLogger file (its first column is not 'step'), so "
            "it cannot be continued; choose another save_dir or filename, or move the file"
        )
    complete = text.endswith("\n")
    rows = lines[1:] if complete else lines[1:-1]
    return lines[0], [row for row in rows if row], complete  # a blank line is no row


def _step_of(row: list[str], path: Path) -> int:
    try:
        return int(row[0])
    except (IndexError, ValueError):
        raise ConfigurationError(
            f"{path} has a row whose step is not an integer ({row!r:.80}), so it cannot be "
            "continued; fix or move the file"
        ) from None


def _new_keys(columns: list[str], values: Mapping[str, object]) -> list[str]:
    return [key for key in values if key not in columns]


def _cell(value: object) -> object:
    # repr keeps every digit of a float and writes nan / inf / -inf; ints stay "3"
    return "" if value is None else repr(value)
