"""TensorBoardLogger: scalars and a hyperparameter table through torch's SummaryWriter.

``tensorboard`` is an optional extra: its presence is checked when the logger is created, and
it is imported on first use, never when ``distkit.loggers`` is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from typing_extensions import override

from distkit._imports import require
from distkit.errors import ConfigurationError, MissingDependencyError
from distkit.loggers._base import (
    Logger,
    as_numbers,
    check_no_file_in_the_way,
    check_save_dir,
    check_step,
)

INSTALL_HINT = "Install it with: pip install 'distkit[tensorboard]' (or pip install tensorboard)."


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files under ``save_dir`` (or ``save_dir/name``).

    Each metric becomes a scalar series at its step; ``log_hyperparams`` writes one markdown
    table to the Text tab (``add_hparams`` is avoided: it creates an extra run per call).
    The ``SummaryWriter``, and with it the folder, is created on first use, so the logger can
    be built on every rank.

    Args:
        save_dir: the folder TensorBoard is pointed at (``tensorboard --logdir save_dir``).
        name: a sub-folder for this run, so several runs can share ``save_dir``.
        strict: True: an error writing the events ends the fit (see :class:`Logger`); False: it
            is reported and training goes on; None (default): the class attribute decides.

    Raises:
        MissingDependencyError: the ``tensorboard`` package is not installed.
        ConfigurationError: a bad argument, or a regular file where the folder must go (found
            by looking only: nothing is created here).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = None,
        *,
        strict: bool | None = None,
    ) -> None:
        super().__init__(strict=strict)
        self.save_dir = check_save_dir("TensorBoardLogger", save_dir)
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigurationError(
                f"TensorBoardLogger(name=...) must be a non-empty str or None, got {name!r}"
            )
        if find_spec("tensorboard") is None:
            raise MissingDependencyError(
                f"TensorBoardLogger needs the 'tensorboard' package, which is not installed. "
                f"{INSTALL_HINT} Or log to CSV with distkit.loggers.CSVLogger, which needs nothing."
            )
        self.log_dir: Path = self.save_dir / name if name else self.save_dir
        call = f"TensorBoardLogger(save_dir={save_dir!r}" + (f", name={name!r})" if name else ")")
        check_no_file_in_the_way(call, self.log_dir, "save_dir and name" if name else "save_dir")
        self._writer: Any = None

    @override
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Write ``params`` as a two-column markdown table, text tag ``hparams``, step 0."""
        if not isinstance(params, Mapping):
            raise ConfigurationError(
                f"params must be a mapping of names to values, got {type(params).__name__}"
            )
        rows = "".join(f"| {_escape(key)} | {_escape(value)} |\n" for key, value in params.items())
        self._get_writer().add_text("hparams", "| name | value |\n|---|---|\n" + rows, 0)

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Add one scalar per name at ``step``."""
        step = check_step(step)
        values = as_numbers(metrics)
        writer = self._get_writer()
        for key, value in values.items():
            writer.add_scalar(key, value, global_step=step)

    @override
    def finalize(self, status: str) -> None:
        """Flush and close the event file (a later call opens a new one)."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def _get_writer(self) -> Any:
        if self._writer is None:
            module = require(
                "torch.utils.tensorboard", feature="TensorBoardLogger", hint=INSTALL_HINT
            )
            self._writer = module.SummaryWriter(log_dir=str(self.log_dir))
        return self._writer


def _escape(value: object) -> str:
    # a "|" would end the cell, a newline the row
    return str(value).replace("|", "\\|").replace("\n", " ")
