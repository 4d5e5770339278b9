"""Turning a training run into a checkpoint payload and back (every rank takes part)."""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from distkit._loop import FitState
from distkit.strategies.base import Strategy


@dataclass
class Run:
    """The objects of a trainer's latest ``fit``, for save_checkpoint / load_checkpoint."""

    model: nn.Module  # the user's, unwrapped (a wrapper is never kept beyond the set-up cache)
    optimizer: torch.optim.Optimizer  # the user's
    scheduler: Any
    state: FitState


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_payload(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: FitState,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The checkpoint dict on rank 0 (``None`` elsewhere). A collective: call on every rank.

    ``model`` is the user's unwrapped module.
    """
    per_rank = strategy.all_gather_object(
        {"rng": ckpt.rng_state(), "loss_sum": float(state.loss_sum), "samples": state.samples}
    )
    if not strategy.is_main:
        return None
    backend_state = strategy.state_dict()
    scaler = backend_state.get("scaler") or ckpt.amp_to_grad_scaler(backend_state.get("amp", {}))
    return {
        "format": ckpt.FORMAT,
        "version": ckpt.VERSION,
        "producer": {
            "strategy": strategy.name,
            "precision": strategy.options.precision,
            "world_size": strategy.world_size,
            "distkit": distkit.__version__,
            "torch": str(torch.__version__),
            "horovod": _version("horovod"),
            "apex": _version("apex"),
        },
        "model": ckpt.model_state(model),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "progress": {
            "epoch": state.epoch,
            "position": state.position,
            "global_step": state.global_step,
            "skipped_steps": state.skipped_steps,
        },
        "ranks": per_rank,
        "history": [dict(record) for record in state.history],
        "extra": extra or {},
    }


def load_weights(
    payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Model and optimizer state into the user's (unwrapped) objects."""
    model.load_state_dict(ckpt.strip_wrapper_prefix(payload["model"]))
    if payload.get("optimizer"):
        optimizer.load_state_dict(payload["optimizer"])


def restore_run(payload: dict[str, Any], strategy: Strategy, scheduler: Any, seed: int) -> FitState:
    """Scaler, scheduler, progress and RNG from ``payload``; call after the strategy's setup."""
    scaler = payload.get("scaler") or {}
    strategy.load_state_dict({"scaler": scaler, "amp": ckpt.grad_scaler_to_amp(scaler)})
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    progress = payload["progress"]
    state = FitState(
        epoch=int(progress["epoch"]),
        position=int(progress["position"]),
        global_step=int(progress["global_step"]),
        skipped_steps=int(progress.get("skipped_steps", 0)),
        history=[dict(record) for record in payload.get("history", [])],
    )
    ranks = payload.get("ranks") or []
    if len(ranks) == strategy.world_size:
        mine = ranks[strategy.rank]
        ckpt.set_rng_state(mine["rng"])
        state.loss_sum, state.samples = float(mine["loss_sum"]), int(mine["samples"])
    else:
        # another world size: the data order is re-cut exactly; per-rank random streams
        # (dropout, augmentation) cannot be carried over, so they are reseeded
        torch.manual_seed(seed + strategy.rank + 1_000_003 * state.global_step)
        if strategy.is_main:
            state.loss_sum = sum(float(r["loss_sum"]) for r in ranks)
            state.samples = sum(int(r["samples"]) for r in ranks)
    return state


def find_resume_payload(
    resume: str | os.PathLike[str] | None,
    folder: ckpt.CheckpointFolder | None,
    device: torch.device,
) -> dict[str, Any] | None:
    """The checkpoint to resume from: a path, the latest in ``folder`` ("auto"), or none."""
    if resume is None:
        return None
    if str(resume) != "auto":
        return ckpt.load(resume, map_location=device)
    if folder is None:
        return None
    latest = folder.latest()
    candidates = [latest] if latest is not None else []
    candidates += [p for p in reversed(folder.checkpoints()) if p != latest]
    for path in candidates:
        try:
            return ckpt.load(path, map_location=device)
        except ckpt.CheckpointError as exc:  # fall back to the previous complete one
            warnings.warn(f"skipping unreadable checkpoint: {exc}", stacklevel=2)
    return None
