"""One backend-neutral checkpoint format, written atomically and read without running code.

A checkpoint is a plain ``torch.save`` of a dict of tensors, numbers, strings, lists and dicts,
so ``torch.load(..., weights_only=True)`` reads it and a file that needs pickled code is
refused. The model state is the unwrapped module's (no ``module.`` prefixes) in fp32; the
optimizer state is the torch optimizer's own ``state_dict`` (keyed by parameter order, the
same whatever wrapper trained it); the loss scaler is in torch ``GradScaler`` form (a strategy
with a scaler of its own converts to and from it in its ``state_dict`` hooks).

A sharded checkpoint (``FSDPStrategy(checkpoint="sharded")``) keeps the model and optimizer
tensors in a folder beside the file, and only their names, shapes and dtypes in it (see
``distkit.checkpoint._shard_files``).
"""

from __future__ import annotations

import os
import pickle
import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distkit._version import __version__
from distkit.checkpoint import _checkpoint_fields as _fields
from distkit.checkpoint import _digest, _layout, _shard_files, _storage
from distkit.checkpoint._folder import LATEST as LATEST
from distkit.checkpoint._folder import CheckpointFolder as CheckpointFolder
from distkit.checkpoint._folder import name_for as name_for
from distkit.checkpoint._folder import step_of as step_of
from distkit.checkpoint._remote_folder import RemoteCheckpointFolder
from distkit.checkpoint._storage import is_url as is_url
from distkit.checkpoint._writes import atomic_save as atomic_save
from distkit.checkpoint._writes import require_weights_only as require_weights_only
from distkit.errors import CheckpointError

FORMAT = "distkit-checkpoint"
#: 2: each entry at the top level, distkit's records under "distkit" (see _layout); 1: the
#: records at the top level (still read)
VERSION = 2
#: the reserved top-level key of a checkpoint's records
RECORDS = _layout.RECORDS
#: the record saying the file carries a digest (so one that lost it is refused)
INTEGRITY = _layout.INTEGRITY


def producer(strategy: str, precision: str, world_size: int, **more: str | None) -> dict[str, Any]:
    """What made a checkpoint, as its records say it (the Trainer's and the Runtime's alike):
    the strategy, its precision and world size, distkit's and torch's versions, and ``more``."""
    return {
        "strategy": strategy,
        "precision": precision,
        "world_size": world_size,
        **more,
        "distkit": __version__,
        "torch": str(torch.__version__),
    }


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
            # .cpu(): a checkpoint loaded onto a GPU (map_location) holds the keys there
            np_state["keys"].cpu().numpy().astype(np.uint32),
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
def load(
    path: str | os.PathLike[str],
    map_location: torch.device | str = "cpu",
    *,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read a distkit checkpoint onto ``map_location``, never running pickled code.

    The file's digest is checked before anything is read (and a sharded checkpoint's shard
    files against theirs), then every field a resume reads. A checkpoint from a distkit that
    wrote no digest loads unverified, with a warning (once per file).

    Args:
        path: the checkpoint file.
        map_location: where its tensors go.
        verify: check the digests (``False`` skips them: only for tools that read a file's
            bookkeeping and not its weights).
        storage_options: for a URL ``path`` (``s3://...``), the fsspec filesystem's options
            (credentials, endpoint); None: its standard configuration.

    Returns the file's entries (``"model"``, ``"optimizer"``, ... or the names ``rt.save``
    was given) and distkit's records (``"producer"``, ``"scaler"``, ...) in one mapping; see
    :func:`load_entries` for the two apart.

    Raises:
        CheckpointError: missing, truncated, corrupt or changed file (its digest differs); a
            file that needs arbitrary pickled objects (refused for safety); not a distkit
            checkpoint; or a field a resume reads is damaged (the error names it).
    """
    return _layout.flat(
        *load_entries(path, map_location, verify=verify, storage_options=storage_options)
    )


def load_entries(
    path: str | os.PathLike[str],
    map_location: torch.device | str = "cpu",
    *,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load`'s reading, as ``(entries, records)``: the file's named entries, and
    distkit's records (the reserved ``"distkit"`` key's). A file of the first layout is read
    into this one."""
    if _storage.is_url(path):
        return _download(os.fspath(path), map_location, verify, storage_options)
    path = _storage.local_path(path)
    _require_torch_file(path)
    verified = _verify_digest(path) if verify else False
    content = _read(path, map_location)
    parts = _layout.split(path, content, FORMAT) if isinstance(content, dict) else None
    if parts is None:
        raise CheckpointError(
            f"{path} is not a distkit checkpoint (no format={FORMAT!r} marker). To start from "
            "plain weights, load them into the model yourself: "
            "model.load_state_dict(torch.load(path, weights_only=True))"
        )
    entries, payload = parts  # (payload: the records, from here on)
    version = payload.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(
            f"{path} is damaged: its field 'version' is {type(version).__name__} {version!r}, "
            "not an int. Resume from another checkpoint"
        )
    if version > VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {payload['version']}, newer than this "
            f"distkit reads ({VERSION}); upgrade distkit"
        )
    if verify and not verified:
        _unverified(path, payload)
    if isinstance(payload.get("shards"), str):  # a sharded checkpoint: its folder sits beside it
        payload["shards"] = str(path.parent / payload["shards"])
        if verify:
            _verify_shards(path, payload)
    _fields.check(path, entries, payload)
    return entries, payload


def _download(
    url: str,
    map_location: torch.device | str,
    verify: bool,
    options: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint object read through a local copy, every check as for a local file (the
    messages name the URL)."""
    remote = _storage.Remote(url, options)
    with _storage.staged(_storage.name_of(url)) as folder:
        local = folder / _storage.name_of(url)
        try:
            remote.get(url, local)
        except FileNotFoundError:
            what = "a folder, not a checkpoint file" if remote.isdir(url) else "not there"
            raise CheckpointError(f"no checkpoint at {url} ({what})") from None
        try:
            entries, records = load_entries(local, map_location, verify=verify)
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace(str(local), url)) from None
    if _shard_files.is_sharded(records):
        raise CheckpointError(
            f"{url} is a sharded checkpoint, and distkit reads sharded checkpoints from local "
            "or shared file systems only (not yet from object stores): copy the file and its "
            "shards folder to a local path and resume from there"
        )
    return entries, records


def _verify_digest(path: Path) -> bool:
    try:
        return _digest.verify(path)
    except _digest.DigestMismatch as exc:
        raise CheckpointError(
            f"{path} is corrupt: its bytes differ from those distkit wrote ({exc}): a flipped "
            "bit, a copy that went wrong, or an edit. Resume from another checkpoint "
            "(resume='auto' falls back to the newest one that verifies)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


#: files loaded without a digest to check, warned about once each
_UNVERIFIED: set[Path] = set()


def _unverified(path: Path, payload: dict[str, Any]) -> None:
    if payload.get(INTEGRITY):  # written with a digest, which is gone: the tail was damaged
        raise CheckpointError(
            f"{path} is damaged: it was written with a {payload[INTEGRITY]} digest at its end, "
            "and that digest is missing or unreadable, so its contents cannot be trusted. "
            "Resume from another checkpoint"
        )
    if path.resolve() not in _UNVERIFIED:
        _UNVERIFIED.add(path.resolve())
        warnings.warn(
            f"{path} carries no digest (written before distkit kept digests, or re-saved by "
            "another tool): it is loaded without checking its bytes. Save it again to add one",
            stacklevel=3,
        )


def _verify_shards(path: Path, payload: dict[str, Any]) -> None:
    folder = Path(payload["shards"])
    if not folder.is_dir():
        raise CheckpointError(
            f"{path} is a sharded checkpoint and its shards folder {folder.name} is not beside "
            "it: copy the checkpoint file together with that folder (or resume from another "
            "checkpoint)"
        )
    digests = payload.get(_shard_files.DIGESTS)
    if digests is None:
        if payload.get(INTEGRITY):
            raise CheckpointError(f"{path} is damaged: its shards have no digests recorded")
        return
    # an older checkpoint hashed the helper files too: one that was deleted is no damage
    digests = {
        name: digest
        for name, digest in digests.items()
        if Path(name).name not in _shard_files.HELPERS or (folder / name).exists()
    }
    try:
        _digest.check_files(folder, digests)
    except _digest.DigestMismatch as exc:
        raise CheckpointError(
            f"{path} has damaged shards in {folder.name}: {exc}. Resume from another "
            "checkpoint (resume='auto' falls back to the newest one that verifies)"
        ) from None


def _read(path: Path, map_location: torch.device | str) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch words every weights-only failure alike; a refused class names a GLOBAL, while
        # random bytes after a pickle header give "Unsupported operand" and the like
        if "Unsupported global" not in str(exc):
            detail = str(exc).partition("WeightsUnpickler error:")[2].strip().split("\n")[0]
            raise CheckpointError(
                f"{path} is corrupt: its pickle cannot be read ({detail or exc}). Resume from "
                "another checkpoint"
            ) from None
        raise CheckpointError(
            f"{path} needs pickled Python objects to load, and distkit loads checkpoints with "
            "weights_only=True so that a file can never run code. Re-save it with plain "
            f"tensors/numbers/strings (torch's error: {str(exc).splitlines()[0]})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated or corrupt?): {exc}"
        ) from None


# torch.save writes a zip archive; before torch 1.6 (or with _use_new_zipfile_serialization=False)
# a raw pickle stream, which starts with the PROTO opcode
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def _require_torch_file(path: Path) -> None:
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file: pass a file in it (step-*.pt), or "
            f"checkpoint_dir={str(path)!r} with resume='auto' for its newest checkpoint"
        )
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    with path.open("rb") as handle:
        head = handle.read(4)
    if not head:
        raise CheckpointError(
            f"{path} is empty (0 bytes): a copy or save that never finished? Resume from "
            "another checkpoint"
        )
    if not head.startswith(_TORCH_MAGIC):
        raise CheckpointError(
            f"{path} is not a torch file (it starts with {head!r}; torch.save writes a zip "
            "archive, which starts with b'PK'): pass a checkpoint written by distkit"
        )


def where(path: str | os.PathLike[str]) -> Path | str:
    """``path`` as a local Path, or a URL as it is (``s3://...``)."""
    return os.fspath(path) if _storage.is_url(path) else _storage.local_path(path)


def checkpoint_folder(
    folder: str | os.PathLike[str],
    keep_last: int = 3,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointFolder:
    """The checkpoint folder at ``folder``: a local one, or one on a store for a URL."""
    if _storage.is_url(folder):
        return RemoteCheckpointFolder(os.fspath(folder), keep_last, storage_options)
    return CheckpointFolder(folder, keep_last)


def shards_named_by(path: Path) -> str | None:
    """The shards folder the checkpoint file ``path`` names (None: a file of one piece)."""
    named = load(path, verify=False).get(_shard_files.KEY)
    return None if named is None else str(named)
