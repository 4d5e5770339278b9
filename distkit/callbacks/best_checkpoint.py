"""BestCheckpoint: keep the checkpoints with the best values of a monitored metric."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distkit._checks import check_ints
from distkit.callbacks._base import Callback
from distkit.callbacks._monitor import Monitor
from distkit.errors import ConfigurationError

if TYPE_CHECKING:
    from distkit.trainer import FitResult, Trainer

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class BestCheckpoint(Callback):
    """Save a checkpoint whenever ``monitor`` reaches one of its ``keep`` best values.

    Files go into the trainer's ``checkpoint_dir`` as
    ``best-<monitor>=<value>-step-<step>.pt``, in the trainer's checkpoint format (weights
    only, written atomically by rank 0), with ``{"monitor", "value", <monitor>}`` in the
    file's ``extra``; the worse ones beyond ``keep`` are deleted. They never count as the
    folder's regular ``step-*.pt`` checkpoints (``keep_last`` and ``resume="auto"`` ignore
    them). Load one with ``trainer.load_checkpoint(path)`` or
    ``distkit.checkpoint.load(path)["model"]``.

    Args:
        monitor: the metric's name (``"val_loss"``, ``"val_miou"``, or ``"train_loss"``).
        mode: ``"min"`` (lower is better) or ``"max"``.
        keep: how many of the best checkpoints to keep (>= 1).
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "min", keep: int = 1) -> None:
        self._monitor = Monitor("BestCheckpoint", monitor, mode)
        self.monitor, self.mode = self._monitor.monitor, self._monitor.mode
        check_ints(keep=(keep, 1))
        self.keep = keep
        self.kept: list[tuple[float, str]] = []  # (value, file name), best first

    @property
    def state_key(self) -> str:
        return self._monitor.key

    @property
    def best_score(self) -> float | None:
        """The best value seen so far (None before the first check)."""
        return self.kept[0][0] if self.kept else None

    def best_path(self, trainer: Trainer) -> Path | None:
        """The best checkpoint file in ``trainer``'s ``checkpoint_dir`` (None before one)."""
        if not self.kept or trainer.checkpoints is None:
            return None
        return trainer.checkpoints.folder / self.kept[0][1]

    def _validate_trainer(self, trainer: Trainer) -> None:
        if trainer.checkpoints is None:
            raise ConfigurationError(
                f"{self!r} writes into the trainer's checkpoint_dir, and this Trainer has "
                "none: pass Trainer(checkpoint_dir=...)"
            )

    def on_fit_start(self, trainer: Trainer) -> None:
        self._monitor.start(trainer)

    def on_validation_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        value = self._monitor.at_validation(trainer, metrics)
        if value is not None:
            self._consider(trainer, value)

    def on_epoch_end(self, trainer: Trainer, record: Mapping[str, float]) -> None:
        value = self._monitor.at_epoch_end(trainer, record)
        if value is not None:
            self._consider(trainer, value)

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        self._monitor.at_fit_end(trainer)

    def _consider(self, trainer: Trainer, value: float) -> None:
        worst = self.kept[-1][0] if len(self.kept) >= self.keep else None
        if not self._monitor.better(value, worst):  # NaN is never better
            return  # every rank sees the same value: all skip, or all save below
        self._validate_trainer(trainer)
        assert trainer.checkpoints is not None
        metric = _UNSAFE.sub("_", self.monitor)
        name = f"best-{metric}={value:.6g}-step-{trainer.global_step:09d}.pt"
        kept = sorted([*self.kept, (value, name)], key=lambda item: item[0],
                      reverse=self.mode == "max")  # fmt: skip
        self.kept, dropped = kept[: self.keep], kept[self.keep :]
        folder = trainer.checkpoints.folder
        extra = {"monitor": self.monitor, "value": value, self.monitor: value}
        trainer.save_checkpoint(folder / name, extra=extra)  # a collective: every rank
        if trainer.is_main:
            for _, old in dropped:
                with contextlib.suppress(FileNotFoundError):
                    (folder / old).unlink()

    def state_dict(self) -> dict[str, Any]:
        return {"kept": [[value, name] for value, name in self.kept]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kept = [(float(value), str(name)) for value, name in state.get("kept", [])]

    def __repr__(self) -> str:
        return f"BestCheckpoint(monitor={self.monitor!r}, mode={self.mode!r}, keep={self.keep})"
