"""Writing a Trainer's checkpoints: every rank takes part, rank 0 writes.

The payload is a collective (every rank's RNG state is gathered, a sharded model's state is
gathered or written by every rank); the write happens on rank 0, and every rank learns how
it went, so no rank goes on while rank 0 is still writing or after its write failed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from distkit import checkpoint as ckpt
from distkit._validate import check_path
from distkit.errors import ConfigurationError
from distkit.runtime import Proposal, exchange, per_data_rank, write_on_rank_zero
from distkit.strategies.base import Strategy
from distkit.trainer import _resume
from distkit.trainer._fit_state import Stateful
from distkit.trainer._resume import LatestFit


def save_to(
    strategy: Strategy,
    run: LatestFit | None,
    callbacks: Stateful,
    path: str | os.PathLike[str],
    extra: dict[str, Any] | None,
) -> None:
    """``trainer.save_checkpoint(path, extra)``: the latest fit's ``run``, written atomically."""
    payload = _payload(strategy, run, callbacks, extra, path)
    write = lambda ready: ckpt.atomic_save(ready, Path(path))  # noqa: E731
    write_on_rank_zero(strategy, payload, write)


def save_to_folder(
    strategy: Strategy, run: LatestFit, callbacks: Stateful, folder: ckpt.CheckpointFolder
) -> None:
    """``run`` into ``checkpoint_dir`` as ``step-<global step>.pt`` (keeping the last K)."""
    step = run.state.global_step
    payload = _payload(strategy, run, callbacks, None, folder.path_for(step))
    write_on_rank_zero(strategy, payload, lambda ready: folder.save(ready, step))


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
    states = strategy.state_io.checkpoint_state(run.model, run.optimizer, Path(path))
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
        if strategy.is_main and Path(path).is_dir():  # rank 0 writes
            raise ckpt.CheckpointError(
                f"{path} is a folder; a checkpoint is a file: pass a path such as "
                f"{Path(path) / 'model.pt'}"
            )
    shared = _resume.rank_state(run.state)
    return Proposal({"global step": str(run.state.global_step)}, states, shared)
