"""The Trainer's checkpoints: a fit turned into a payload and back, the one to resume from
found (``resume="auto"``), and refused where it does not fit (every rank takes part)."""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit import checkpoint as ckpt
from distkit import registry
from distkit.checkpoint import _shard_files
from distkit.checkpoint._fits import model_misfits
from distkit.errors import ConfigurationError
from distkit.strategies.base import Strategy
from distkit.strategies.capabilities import StateIO
from distkit.trainer._fit_state import FitState


@dataclass
class LatestFit:
    """The objects of a trainer's latest ``fit``, for save_checkpoint / load_checkpoint."""

    model: nn.Module  # the user's, unwrapped (a wrapper is never kept beyond the set-up cache)
    optimizer: torch.optim.Optimizer  # the user's
    scheduler: Any
    state: FitState
    #: len(train_data): a mid-epoch position means something only for it (None: a stream)
    train_samples: int | None


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint to resume from, and how to name it in messages."""

    label: str  # the file name and its step, e.g. "step-000000004.pt (step 4)"
    payload: dict[str, Any]

    @classmethod
    def of(cls, path: str | os.PathLike[str], payload: dict[str, Any]) -> LoadedCheckpoint:
        step = payload.get("progress", {}).get("global_step")
        # a URL's last part too ("s3://bucket/run/step-000000004.pt")
        return cls(f"{Path(os.fspath(path)).name} (step {step})", payload)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def rank_state(state: FitState) -> dict[str, Any]:
    """What each rank adds to a checkpoint: its RNG states and partial loss sums."""
    return {"rng": ckpt.rng_state(), **state.rank_state()}


def build_payload(
    strategy: Strategy,
    run: LatestFit,
    extra: dict[str, Any] | None,
    ranks: list[dict[str, Any]],
    states: dict[str, Any],
) -> dict[str, Any]:
    """The checkpoint dict (built on rank 0) from ``run``, every rank's :func:`rank_state`
    and rank 0's :meth:`~distkit.Strategy.checkpoint_state` (``states``)."""
    shared = run.state.shared_state()
    scaler = strategy.precision.state_dict()  # GradScaler form, whatever the backend
    return {
        "format": ckpt.FORMAT,
        "version": ckpt.VERSION,
        "producer": ckpt.producer(
            strategy.name,
            strategy.options.precision,
            strategy.world_size,
            optimizer=type(run.optimizer).__name__,
            # every built-in backend's library (and the strategy's own), named by the classes
            **{lib: _version(lib) for lib in registry.DEFAULT_REGISTRY.libraries(type(strategy))},
        ),
        **states,  # model and optimizer (and, when sharded, the shards folder)
        "scaler": scaler,
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "progress": {
            **{key: shared[key] for key in ("epoch", "position", "global_step", "skipped_steps")},
            "train_samples": run.train_samples,
        },
        "ranks": ranks,
        "history": shared["history"],
        "validations": shared["validations"],
        "extra": extra or {},
    }


def load_weights(
    strategy: Strategy, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Model and optimizer state into the user's (unwrapped) objects, set up or not."""
    if _shard_files.is_sharded(payload):  # read into the tensors, whatever their layout
        strategy.state_io.load_sharded(payload, model, optimizer)
        return
    strategy.state_io.load_model_state_dict(model, ckpt.strip_wrapper_prefix(payload["model"]))
    if payload.get("optimizer"):
        strategy.state_io.load_optimizer_state_dict(optimizer, payload["optimizer"])


def restore_run(payload: dict[str, Any], strategy: Strategy, scheduler: Any, seed: int) -> FitState:
    """Scaler, scheduler, progress and RNG from ``payload``; call after the strategy's setup."""
    strategy.precision.load_state_dict(payload.get("scaler") or {})
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    state = FitState()
    state.load_shared_state(
        {
            **payload["progress"],
            "history": payload.get("history", []),
            "validations": payload.get("validations", []),
        }
    )
    ranks = payload.get("ranks") or []
    if len(ranks) == strategy.data_world_size:  # one per data-parallel rank (per_data_rank)
        mine = ranks[strategy.data_rank]
        ckpt.set_rng_state(mine["rng"])
        state.load_rank_state(mine)
    else:
        state.load_rank_state(None)  # each rank's place in a stream of its own is lost
        # another world size: the data order is re-cut exactly; per-rank random streams
        # (dropout, augmentation) cannot be carried over, so they are reseeded
        torch.manual_seed(seed + strategy.data_rank + 1_000_003 * state.global_step)
        if strategy.is_main:
            state.loss_sum = sum(float(r["loss_sum"]) for r in ranks)
            state.samples = sum(int(r["samples"]) for r in ranks)
    return state


def find_resume(
    resume: str | os.PathLike[str] | None,
    folder: ckpt.CheckpointFolder | None,
    device: torch.device,
    *,
    announce: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> LoadedCheckpoint | None:
    """The checkpoint to resume from: a path, the newest one in ``folder`` that loads and
    verifies ("auto"), or none.

    "auto" goes by the step numbers in the file names, the highest first, falling back to the
    one before when a file is unreadable, corrupt or damaged (saying so when ``announce``: on
    rank 0; every rank takes the same decision, as each reads the same files, and the fit's
    agreement compares the choices); the ``latest`` pointer is only a hint, checked against
    the choice (it can lag behind after a crash between the file and the pointer).
    """
    if resume is None:
        return None
    options = storage_options
    if str(resume) != "auto":
        loaded = ckpt.load(resume, map_location=device, storage_options=options)
        return LoadedCheckpoint.of(resume, loaded)
    if folder is None:
        return None
    skipped: list[str] = []
    options = folder.storage_options or options
    for path in reversed(folder.checkpoints()):
        try:
            loaded = ckpt.load(path, map_location=device, storage_options=options)
            found = LoadedCheckpoint.of(path, loaded)
        except ckpt.CheckpointError as exc:  # fall back to the previous complete one
            skipped.append(str(exc))
            continue
        if announce and skipped:
            warnings.warn(
                f"resume='auto': resuming from {found.label}, the newest checkpoint in "
                f"{folder.where} that loads and verifies; skipped {len(skipped)} newer "
                f"one(s): {'; '.join(skipped)}",
                stacklevel=2,
            )
        if announce and not skipped:  # after a fall-back the pointer names a skipped file
            _compare_with_pointer(folder, path)
        return found
    if skipped:
        raise ckpt.CheckpointError(
            f"resume='auto' found {len(skipped)} checkpoint(s) in {folder.where} and none "
            f"loads: {'; '.join(skipped)}. Move the folder aside to start afresh, or pass "
            "resume=<a file that loads>"
        )
    return None


def _compare_with_pointer(folder: ckpt.CheckpointFolder, chosen: Path | str) -> None:
    pointed = folder.latest()
    if pointed is None or str(pointed) == str(chosen):
        return
    # written after the chosen one: another run's
    if folder.written_ns(pointed) > folder.written_ns(chosen):
        warnings.warn(
            f"resuming from {_name(chosen)}, the highest step in {folder.where}, although "
            f"'latest' names {_name(pointed)}, written after it: the folder holds files of two "
            "runs. Give each run its own checkpoint_dir",
            stacklevel=3,
        )


def _name(path: Path | str) -> str:
    return Path(path).name  # a URL's last part too


def check_fits(
    found: LoadedCheckpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_samples: int | None = None,
    epoch_samples: int | None = None,
    *,
    io: StateIO | None = None,
) -> None:
    """Refuse, naming the difference, a checkpoint that does not fit this model, optimizer or
    training data (checked before anything is loaded, so a refused fit changes nothing).

    ``train_samples`` is ``len(train_data)`` (None: unknown, a stream); ``epoch_samples`` the
    samples of an epoch's order where that is fixed (``len(sampler)`` for a user's sampler;
    None: it varies, a batch sampler's, whose plan checks the position when it resumes).
    ``io``: the strategy's StateIO, which tells the full shapes of a set-up model and the
    user's parameters of a set-up optimizer (a backend may partition both); None: the
    model's and optimizer's own.
    """
    for key in ("model", "progress"):
        if not isinstance(found.payload.get(key), dict):
            raise ckpt.CheckpointError(
                f"{found.label} has no {key} state: it is not a checkpoint distkit can resume "
                "from (write checkpoints with Trainer.save_checkpoint or checkpoint_dir=...)"
            )
    io = io or StateIO(_AsTheyAre())
    _check_model_fits(found, io.shapes(model), model)
    _check_optimizer_fits(found, optimizer, [len(g) for g in io.param_groups(optimizer)])
    if train_samples is None:
        return
    progress = found.payload["progress"]
    position, saved = int(progress["position"]), progress.get("train_samples")
    # a checkpoint from the last step of an epoch has position == its length: still valid
    beyond = epoch_samples is not None and position > epoch_samples
    if position and (beyond or saved not in (None, train_samples)):
        of = "" if saved is None else f" of {saved}"
        drawn = "" if epoch_samples in (None, train_samples) else f" ({epoch_samples} drawn)"
        raise ConfigurationError(
            f"{found.label} stopped mid-epoch after {position}{of} samples; train_data has "
            f"{train_samples}{drawn}. A mid-epoch resume continues the epoch's order, which "
            "depends on the data's length: resume with the same train_data, or from a "
            "checkpoint saved at the end of an epoch (checkpoint_every='epoch')"
        )


class _AsTheyAre:
    """No strategy's view: the model and optimizer as they are (their own state_dicts)."""

    is_main = True


def _check_model_fits(
    found: LoadedCheckpoint, current: dict[str, torch.Size | None], model: nn.Module
) -> None:
    saved = ckpt.strip_wrapper_prefix(found.payload["model"])
    problems = model_misfits(saved, current, model)
    if problems:
        raise ckpt.CheckpointError(
            f"{found.label} does not fit this model: {'; '.join(problems[:5])}. Resume with the "
            "model it was saved from (same layers and sizes)"
        )


def _check_optimizer_fits(
    found: LoadedCheckpoint, optimizer: torch.optim.Optimizer, my_sizes: list[int]
) -> None:
    state = found.payload.get("optimizer")
    if not state:
        return
    name, mine = found.payload.get("producer", {}).get("optimizer"), type(optimizer).__name__
    groups = state.get("param_groups", [])
    saved_keys = set().union(*(g.keys() for g in groups)) if groups else set()
    my_keys = set().union(*(g.keys() for g in optimizer.param_groups))
    # a newer torch adds settings to an optimizer (and fills them in when loading); two
    # optimizers differ when each has settings the other lacks (SGD's momentum, Adam's betas)
    other_kind = (name is not None and name != mine) or (
        name is None and saved_keys - my_keys and my_keys - saved_keys
    )
    fix = (
        "Resume with the optimizer it was saved with, or start this one afresh from the "
        "weights alone: model.load_state_dict(distkit.checkpoint.load(path)['model'])"
    )
    if other_kind:
        raise ckpt.CheckpointError(
            f"{found.label} holds the optimizer state of {name or 'another optimizer'}; this "
            f"optimizer is {mine}. {fix}"
        )
    sizes = [len(g["params"]) for g in groups]
    if sizes != my_sizes:
        raise ckpt.CheckpointError(
            f"{found.label} holds optimizer state for parameter groups of sizes {sizes}; this "
            f"optimizer's are {my_sizes}. {fix}"
        )
