"""Writing a Trainer's checkpoints: every rank takes part, rank 0 writes.

The payload is a collective (every rank's RNG state is gathered, a sharded model's state is
gathered or written by every rank); the write happens on rank 0, and every rank learns how
it went, so no rank goes on while rank 0 is still writing or after its write failed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distkit import checkpoint as ckpt
from distkit._validate import check_path
from distkit.errors import ConfigurationError
from distkit.runtime import PendingSave, Proposal, exchange, per_data_rank, write_on_rank_zero
from distkit.strategies.base import Strategy
from distkit.trainer import _resume
from distkit.trainer._config import TrainerConfig
from distkit.trainer._fit_state import Stateful
from distkit.trainer._logging import LogSink
from distkit.trainer._resume import LatestFit


def save_to(
    strategy: Strategy,
    run: LatestFit | None,
    callbacks: Stateful,
    path: str | os.PathLike[str],
    extra: dict[str, Any] | None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """``trainer.save_checkpoint(path, extra)``: the latest fit's ``run``, written atomically."""
    payload = _payload(strategy, run, callbacks, extra, path)
    write = lambda ready: ckpt.atomic_save(  # noqa: E731
        ready, path, storage_options=storage_options
    )
    write_on_rank_zero(strategy, payload, write)


class FolderSaves:
    """A fit's saves into ``checkpoint_dir`` as ``step-<global step>.pt`` (keeping the last
    K): written before training goes on, or (``background``) staged and persisted by a
    thread on rank 0 while it does, each save waiting for the one before it."""

    def __init__(
        self,
        strategy: Strategy,
        run: LatestFit,
        callbacks: Stateful,
        folder: ckpt.CheckpointFolder,
        *,
        background: bool = False,
    ) -> None:
        self.strategy, self.run, self.callbacks, self.folder = strategy, run, callbacks, folder
        self.background = background
        self.pending: PendingSave | None = None
        #: where the fit's end logs the time it waited (None: not logged)
        self.sink: LogSink | None = None

    @classmethod
    def of(
        cls,
        strategy: Strategy,
        run: LatestFit,
        callbacks: Stateful,
        folder: ckpt.CheckpointFolder | None,
        config: TrainerConfig,
        sink: LogSink,
    ) -> FolderSaves | None:
        """The fit's saves into ``folder`` as ``config`` says (None: no checkpoint_dir)."""
        if folder is None:
            return None
        saves = cls(strategy, run, callbacks, folder, background=config.checkpoint_async)
        saves.sink = sink
        return saves

    def save(self) -> None:
        """Save the run now (a collective)."""
        self.wait()  # never two in flight; a failed one raises here, on every rank
        strategy, folder = self.strategy, self.folder
        step = self.run.state.global_step
        payload = _payload(strategy, self.run, self.callbacks, None, folder.path_for(step))
        write = lambda ready: folder.save(ready, step)  # noqa: E731
        if self.background:
            what = f"the checkpoint of step {step} to {folder.path_for(step)}"
            models = {"model": self.run.model}  # its state: copies, unless it shares storages
            self.pending = PendingSave.start(strategy, payload, write, what, models)
        else:
            write_on_rank_zero(strategy, payload, write)

    def wait(self) -> float:
        """Wait for the save in flight, if any (a collective); the seconds waited."""
        pending, self.pending = self.pending, None
        return 0.0 if pending is None else pending.wait()

    def finish(self) -> None:
        """The fit's end: a checkpoint persisting in the background is complete before
        ``fit`` returns (a collective: every rank learns how it went); the time this waited
        is logged as ``checkpoint_wait_s``."""
        if self.pending is None:
            return
        waited = self.wait()
        if self.sink is not None:
            self.sink.log({"checkpoint_wait_s": waited}, self.run.state.global_step)
            self.sink.flush()

    def finish_here(self) -> None:
        """A failing fit: let rank 0's write end (no collective: see PendingSave)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.finish_here()


def _payload(
    strategy: Strategy,
    run: LatestFit | None,
    callbacks: Stateful,
    extra: dict[str, Any] | None,
    path: str | os.PathLike[str],
) -> dict[str, Any] | None:
    """The checkpoint on rank 0 (None elsewhere): a collective that every rank joins."""
    callback_states, ranks = exchange(
        strategy, "save_checkpoint", lambda: prepare_save(strategy, run, callbacks, extra, path)
    )
    assert run is not None  # prepare_save refused a missing run on every rank
    ranks = per_data_rank(strategy, ranks)  # one per data-parallel rank
    # every rank: gathering (or writing) a sharded model's state is a collective
    states = strategy.state_io.checkpoint_state(run.model, run.optimizer, ckpt.where(path))
    if not strategy.is_main:
        return None
    payload = _resume.build_payload(strategy, run, extra, ranks, states)
    payload["callbacks"] = callback_states
    return payload


def prepare_save(
    strategy: Strategy,
    run: LatestFit | None,
    callbacks: Stateful,
    extra: object,
    path: str | os.PathLike[str] | None,
) -> Proposal[dict[str, Any]]:
    """Checks, this rank's state for the file; the local part: the callbacks' states."""
    if run is None:
        raise ConfigurationError("save_checkpoint needs a model: call fit(...) first")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigurationError(
            "extra must be a dict (of tensors, numbers, strings, lists and dicts), got "
            f"{type(extra).__name__}"
        )
    # before the checks that differ between ranks: a callback's state may be a collective
    # (EMA's averages under fsdp are gathered), met here by every rank, or by none
    states = callbacks.state_dict()  # checked on every rank, before the agreement
    if path is not None:
        check_path("path", path, "a file path (str or os.PathLike)")
        if strategy.is_main and not ckpt.is_url(path) and Path(path).is_dir():  # rank 0 writes
            raise ckpt.CheckpointError(
                f"{path} is a folder; a checkpoint is a file: pass a path such as "
                f"{Path(path) / 'model.pt'}"
            )
    shared = _resume.rank_state(run.state)
    return Proposal({"global step": str(run.state.global_step)}, states, shared)
