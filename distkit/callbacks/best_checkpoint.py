"""BestCheckpoint: keep the checkpoints with the best values of a monitored metric."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from distkit._validate import check_ints
from distkit.callbacks._base import Callback
from distkit.callbacks._best_files import BestFiles
from distkit.callbacks._monitor import Monitor
from distkit.errors import ConfigurationError

if TYPE_CHECKING:
    from distkit.trainer import FitResult, Trainer


class BestCheckpoint(Callback):
    """Save a checkpoint whenever ``monitor`` reaches one of its ``keep`` best values.

    Files go into the trainer's ``checkpoint_dir`` as
    ``best-<monitor>=<value>-step-<step>.pt``, in the trainer's checkpoint format (weights
    only, written atomically by rank 0), with ``{"monitor", "value", <monitor>}`` in the
    file's ``extra``. ``keep`` holds for the folder, across runs that share it: at each
    check rank 0 lists the folder's files of this monitor and every rank ranks them alike by
    the value in their names (6 significant digits; of equal values the earlier step
    ranks first), whichever run wrote them. A value is saved only when it beats the
    ``keep``-th of them; the folder then keeps the ``keep`` best and rank 0 deletes the
    others. So a file is deleted only when a better one was just saved, and a file whose
    name holds no value (renamed by hand) is never counted or deleted. The names do not
    record ``mode``: runs that share a folder must monitor a metric with the same ``mode``.
    The files never count as the folder's regular ``step-*.pt`` checkpoints (``keep_last``
    and ``resume="auto"`` ignore them). Load one with ``trainer.load_checkpoint(path)`` or
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

    @override
    @property
    def state_key(self) -> str:
        return self._monitor.key

    @property
    def best_score(self) -> float | None:
        """The best value in the folder at the last check (None before one); this run's own
        values exactly, another run's as its file name holds it."""
        return self.kept[0][0] if self.kept else None

    def best_path(self, trainer: Trainer) -> Path | None:
        """The best checkpoint file in ``trainer``'s ``checkpoint_dir`` at the last check
        (None before one); another run may have written it."""
        if not self.kept or trainer.checkpoints is None:
            return None
        return trainer.checkpoints.folder / self.kept[0][1]

    def _validate_trainer(self, trainer: Trainer) -> None:
        if trainer.checkpoints is None:
            raise ConfigurationError(
                f"{self!r} writes into the trainer's checkpoint_dir, and this Trainer has "
                "none: pass Trainer(checkpoint_dir=...)"
            )
        if trainer.checkpoints.storage_options is not None:  # a folder on a store
            raise ConfigurationError(
                f"{self!r} keeps its files in a local checkpoint_dir, and this Trainer's is "
                f"{trainer.checkpoints.where}, on an object store (not yet supported there). "
                "Give the Trainer a local or shared-file-system checkpoint_dir, or drop "
                "BestCheckpoint and keep the last checkpoints (keep_last=...) on the store"
            )

    @override
    def on_fit_start(self, trainer: Trainer) -> None:
        self._monitor.start(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        value = self._monitor.at_validation(trainer, metrics)
        if value is not None:
            self._consider(trainer, value)

    @override
    def on_epoch_end(self, trainer: Trainer, record: Mapping[str, float]) -> None:
        value = self._monitor.at_epoch_end(trainer, record)
        if value is not None:
            self._consider(trainer, value)

    @override
    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        self._monitor.at_fit_end(trainer)

    def _consider(self, trainer: Trainer, value: float) -> None:
        self._validate_trainer(trainer)
        assert trainer.checkpoints is not None
        files = BestFiles.of(trainer.checkpoints.folder, self.monitor, self.mode)
        name = files.name(value, trainer.global_step)
        # rank 0's listing on every rank: the ranks decide alike whether to save (a
        # collective), even where each rank's checkpoint_dir is a folder of its own
        listed = trainer.strategy.broadcast(files.on_disk() if trainer.is_main else None)
        ranked = files.ranked(n for n in listed if n != name)  # a save replaces its namesake
        worst = ranked[self.keep - 1][0] if len(ranked) >= self.keep else None
        # compared as the names hold the values, as every run sharing the folder compares
        written = files.score(name)
        if written is None or not self._monitor.better(written, worst):  # NaN never is
            self.kept = self._exact(ranked[: self.keep])
            return  # every rank sees the same value and listing: all skip, or all save
        extra = {"monitor": self.monitor, "value": value, self.monitor: value}
        trainer.save_checkpoint(files.folder / name, extra=extra)  # a collective: every rank
        self.kept.append((value, name))  # its exact value, for _exact
        ranked = files.ranked([name, *(old for _, old in ranked)])
        self.kept = self._exact(ranked[: self.keep])
        if trainer.is_main:
            files.delete(old for _, old in ranked[self.keep :])
            files.delete_stale_temp_files()

    def _exact(self, ranked: list[tuple[float, str]]) -> list[tuple[float, str]]:
        """``ranked`` with the values this callback saved exact (a name holds 6 digits)."""
        own = {name: value for value, name in self.kept}
        return [(own.get(name, value), name) for value, name in ranked]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"kept": [[value, name] for value, name in self.kept]}

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kept = [(float(value), str(name)) for value, name in state.get("kept", [])]

    @override
    def __repr__(self) -> str:
        return f"BestCheckpoint(monitor={self.monitor!r}, mode={self.mode!r}, keep={self.keep})"
