"""One backend-neutral checkpoint format, written atomically and read without running code.

A checkpoint is a plain ``torch.save`` of a dict of tensors, numbers, strings, lists and dicts,
so ``torch.load(..., weights_only=True)`` reads it and a file that needs pickled code is
refused. The model state is the unwrapped module's (no ``module.`` prefixes) in fp32; the
optimizer state is the torch optimizer's own ``state_dict`` (keyed by parameter order, the
same whatever wrapper trained it); the loss scaler is in torch ``GradScaler`` form (apex amp's
is converted both ways).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distkit.errors import DistkitError

FORMAT = "distkit-checkpoint"
VERSION = 1
LATEST = "latest"
_PREFIX = "step-"


class CheckpointError(DistkitError, RuntimeError):
    """A checkpoint could not be written or read (corrupt, unsafe, or of another format)."""


# ---------------------------------------------------------------------- state conversion
def model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state on CPU, reduced-precision floats upcast to fp32."""
    out = {}
    for key, value in module.state_dict().items():
        tensor = value.detach().cpu()
        if tensor.is_floating_point() and tensor.dtype in (torch.float16, torch.bfloat16):
            tensor = tensor.float()
        out[key] = tensor.clone()
    return out


def strip_wrapper_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` prefixes a DDP/DataParallel wrapper left in a foreign state dict."""
    if state and all(key.startswith("module.") for key in state):
        return {key[len("module.") :]: value for key, value in state.items()}
    return dict(state)


def amp_to_grad_scaler(amp_state: Mapping[str, Any]) -> dict[str, Any]:
    """apex ``amp.state_dict()`` -> torch ``GradScaler.state_dict()`` form."""
    scaler = amp_state.get("loss_scaler0")
    if not scaler:
        return {}
    return {
        "scale": float(scaler["loss_scale"]),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": int(scaler.get("unskipped", 0)),
    }


def grad_scaler_to_amp(scaler_state: Mapping[str, Any]) -> dict[str, Any]:
    """torch ``GradScaler.state_dict()`` -> apex ``amp.state_dict()`` form."""
    if not scaler_state:
        return {}
    return {
        "loss_scaler0": {
            "loss_scale": float(scaler_state["scale"]),
            "unskipped": int(scaler_state.get("_growth_tracker", 0)),
        }
    }


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and ``random`` generator states, as weights-only data."""
    np_state: Any = np.random.get_state(legacy=True)
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


# ---------------------------------------------------------------------- files
def atomic_save(payload: Mapping[str, Any], path: Path) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves either the old file or the new one.

    Temp file in the same folder, flushed and fsynced, renamed over the target, folder fsynced.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(dict(payload), handle)
            handle.flush()
            os.fsync(handle.fileno())
        _require_weights_only(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _require_weights_only(path: Path) -> None:
    """Refuse to publish a file that ``load`` would refuse (checked before the rename)."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            "the checkpoint holds an object that cannot be loaded weights-only (only tensors, "
            "numbers, strings, lists and dicts can): store plain values in extra=... (e.g. "
            f"obj.state_dict()). Nothing was written. torch: {str(exc).splitlines()[0]}"
        ) from None


def _atomic_write_text(text: str, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load(path: str | os.PathLike[str], map_location: torch.device | str = "cpu") -> dict[str, Any]:
    """Read a distkit checkpoint onto ``map_location``, never running pickled code.

    Raises:
        CheckpointError: missing, truncated or corrupt file; a file that needs arbitrary
            pickled objects (refused for safety); or not a distkit checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} needs pickled Python objects to load, and distkit loads checkpoints with "
            "weights_only=True so that a file can never run code. Re-save it with plain "
            f"tensors/numbers/strings (torch's error: {str(exc).splitlines()[0]})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated or corrupt?): {exc}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a distkit checkpoint (no format={FORMAT!r} marker). To start from "
            "plain weights, load them into the model yourself: "
            "model.load_state_dict(torch.load(path, weights_only=True))"
        )
    if payload.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {payload['version']}, newer than this "
            f"distkit reads ({VERSION}); upgrade distkit"
        )
    return payload


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


class CheckpointFolder:
    """A folder of ``step-XXXXXXXX.pt`` files with a ``latest`` pointer; keeps the last K.

    Args:
        folder: where checkpoints go (every rank must see it when resuming).
        keep_last: how many checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, folder: str | os.PathLike[str], keep_last: int = 3) -> None:
        self.folder = Path(folder)
        self.keep_last = keep_last

    def path_for(self, global_step: int) -> Path:
        return self.folder / f"{_PREFIX}{global_step:09d}.pt"

    def save(self, payload: Mapping[str, Any], global_step: int) -> Path:
        path = self.path_for(global_step)
        atomic_save(payload, path)
        _atomic_write_text(path.name + "\n", self.folder / LATEST)
        # by write time, not by step number: files a previous run left with higher step
        # numbers are older than the one just written, and go first
        others = sorted((p for p in self.checkpoints() if p != path), key=_mtime)
        for old in others[: max(0, len(others) - (self.keep_last - 1))]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        return path

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint files, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(self.folder.glob(f"{_PREFIX}*.pt"))

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, else the newest file, else ``None``."""
        pointer = self.folder / LATEST
        if pointer.is_file():
            named = self.folder / pointer.read_text().strip()
            if named.is_file():
                return named
        found = self.checkpoints()
        return found[-1] if found else None
